"""Profile the broker's hot paths: py-spy samples the uvicorn process under one load, Redis's
SLOWLOG (threshold 0 on the private server) times every command, and both are summarised.

    python -m benchmarks.profile ingest             # msgpack, 64 rollouts per request
    python -m benchmarks.profile ingest --fmt json --per-req 1
    python -m benchmarks.profile lease              # lease 256 + ack with logprobs
    python -m benchmarks.profile lease --out /tmp/prof   # keep the raw (collapsed) stacks
    python -m benchmarks.profile work               # work lease of 64 prompts + return
    python -m benchmarks.profile lease --tokens 32768 --size 16   # long rollouts

Needs ``py-spy`` (pip install py-spy) and root or ptrace rights over the server process.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from app import keys
from benchmarks import load, load_prompts
from benchmarks.harness import BIG, ROOT, Bench, Sizes, delete_keys
from benchmarks.load import run_group
from benchmarks.payloads import TOKENS
from benchmarks.servers import proc_cpu_s, redis_server, uvicorn_server


def script_names(app_dir: Path) -> dict[str, str]:
    """SHA1 -> script name, for trees older than the function library, whose scripts ran with
    EVALSHA (the key prologue, common.lua or the libraries, the script). A function library's
    functions are named after their scripts (``rollout_broker_<digest>_<script>``)."""
    lua = app_dir / "app" / "broker" / "lua"
    names: dict[str, str] = {}
    if not lua.is_dir():
        return names
    common = (lua / "common.lua").read_text() if (lua / "common.lua").exists() else ""
    for f in lua.glob("*.lua"):
        body = f.read_text()
        for src in (keys.lua_prologue() + common + "\n" + body, common + "\n" + body, body):
            names[hashlib.sha1(src.encode()).hexdigest()] = f.stem
    return names


def _frame(raw: str) -> tuple[str, str]:
    """('func (pkg/module.py)', 'pkg') of one py-spy frame 'func (pkg/module.py:line)'."""
    func, _, where = raw.partition(" (")
    path = where.rsplit(":", 1)[0] if where else "?"
    pkg = path.split("/", 1)[0] if "/" in path else path.removesuffix(".py")
    return f"{func} ({path})", pkg


def summarise_stacks(path: Path, top: int) -> str:
    """Shares of the server's busy samples from py-spy's raw (collapsed) output: by package
    of the running frame, by running function, and inclusive per function of the app."""
    self_fn: collections.Counter[str] = collections.Counter()
    self_pkg: collections.Counter[str] = collections.Counter()
    incl_app: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [_frame(f) for f in stack.split(";")]
        leaf, pkg = frames[-1]
        self_fn[leaf] += n
        self_pkg[pkg] += n
        for name in {f for f, p in frames if p in ("app", "workers")}:
            incl_app[name] += n
    if not total:
        return "no samples (is py-spy allowed to attach?)"
    out = [f"{total} samples of the busy server thread (idle time is not sampled)"]
    out.append("\nself time by package of the running frame:")
    out += [f"  {n / total:6.1%}  {pkg}" for pkg, n in self_pkg.most_common(12)]
    out.append("\nself time by function:")
    out += [f"  {n / total:6.1%}  {fr}" for fr, n in self_fn.most_common(top)]
    out.append("\ninclusive time of the broker's own functions:")
    out += [f"  {n / total:6.1%}  {fr}" for fr, n in incl_app.most_common(top)]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.profile")
    p.add_argument("workload", choices=["ingest", "lease", "work"])
    p.add_argument("--fmt", choices=["msgpack", "json"], default="msgpack")
    p.add_argument("--per-req", type=int, default=64, help="rollouts per ingest request")
    p.add_argument("--tokens", type=int, default=TOKENS, help="response tokens per rollout")
    p.add_argument(
        "--size", type=int, default=None, help="lease batch size (256), work lease size (64)"
    )
    p.add_argument("--queued", type=int, default=10_000, help="prompts queued for work")
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--app-dir", default=str(ROOT))
    p.add_argument("--native", action="store_true", help="py-spy --native (C frames too)")
    p.add_argument(
        "--slowlog-us",
        type=int,
        default=20,
        help="log Redis commands at least this slow (0: every command, nested ones "
        "too, which adds about a microsecond to each)",
    )
    p.add_argument("--out", help="folder to keep stacks.txt (collapsed stacks) in")
    args = p.parse_args(argv)
    if shutil.which("py-spy") is None:
        p.error("py-spy is not installed: pip install py-spy")
    app_dir = Path(args.app_dir).resolve()
    out_dir = Path(args.out) if args.out else None
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)

    with tempfile.TemporaryDirectory(prefix="rb-prof-") as tmp:
        work = Path(tmp)
        with redis_server(work) as rt:
            if not rt.private:
                p.error("profiling needs a private redis-server (SLOWLOG is reset and read)")
            rc = rt.client()
            prefix = "rbprof"
            env = {"BROKER_REDIS_URL": rt.url, "BROKER_REDIS_PREFIX": prefix}
            with uvicorn_server(
                "broker", "app.main:create_app", cwd=app_dir, workdir=work, env=env, factory=True
            ) as broker:
                bench = Bench(Sizes(), rt, broker, broker, prefix, rc, rt.pid)
                if args.workload == "ingest":
                    run = bench.new_run("prof-ingest")
                    fn: Callable[..., load.Result] = load.http_ingest
                    kw = dict(
                        address=broker.address,
                        path=f"/v1/runs/{run}/rollouts",
                        fmt=args.fmt,
                        per_req=args.per_req,
                        tag="p",
                        worker=0,
                        duration=args.seconds,
                        max_ops=BIG,
                        tokens=args.tokens,
                    )
                elif args.workload == "work":
                    run = bench.new_run("prof-work", step_groups=1_000_000)
                    bench.register_prompts(run, args.queued, "p")
                    fn = load_prompts.http_work_return
                    kw = dict(
                        address=broker.address,
                        run_id=run,
                        size=args.size or 64,
                        duration=args.seconds,
                        max_ops=BIG,
                    )
                else:
                    args.size = args.size or 256
                    run = bench.new_run("prof-lease", max_reuse=10_000)
                    # As many rollout bytes buffered as 4,096 rollouts of 1,024 tokens.
                    n = max(4096 * TOKENS // args.tokens, 4 * args.size)
                    bench.fill(run, n, "p", per_req=min(256, args.size), tokens=args.tokens)
                    fn = load.http_lease_ack
                    kw = dict(
                        address=broker.address,
                        run_id=run,
                        size=args.size,
                        fmt=args.fmt,
                        duration=args.seconds,
                        max_ops=BIG,
                        stop_on_empty=False,
                        tokens=args.tokens,
                    )
                rc.config_set("slowlog-log-slower-than", args.slowlog_us)
                rc.config_set("slowlog-max-len", 1_000_000)
                rc.slowlog_reset()
                stacks = (out_dir or work) / "stacks.txt"
                spy = [
                    "py-spy",
                    "record",
                    "--pid",
                    str(broker.pid),
                    "--rate",
                    str(args.rate),
                    "--duration",
                    str(int(args.seconds) + 1),
                    "--format",
                    "raw",
                    "-o",
                    str(stacks),
                ]
                if args.native:
                    spy.append("--native")
                spy_proc = subprocess.Popen(
                    spy, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                )
                time.sleep(0.5)  # attached
                cpu0_b, cpu0_r = proc_cpu_s(broker.pid), proc_cpu_s(rt.pid or 0)
                g = run_group(fn, [kw], timeout=args.seconds + 300)
                cpu_b = proc_cpu_s(broker.pid) - cpu0_b
                cpu_r = proc_cpu_s(rt.pid or 0) - cpu0_r
                spy_proc.wait(timeout=args.seconds + 60)
                entries = rc.slowlog_get(-1)
                rc.config_set("slowlog-log-slower-than", 10_000)
                delete_keys(rc, list(rc.scan_iter(match=keys.every_key(prefix), count=2000)))
            rc.close()

        names = script_names(app_dir)
        per_cmd: dict[str, list[int]] = collections.defaultdict(list)
        for e in entries:
            raw_cmd = e["command"]
            text = raw_cmd.decode(errors="replace") if isinstance(raw_cmd, bytes) else str(raw_cmd)
            cmd = text.split(" ", 2)[:2]
            name = cmd[0].upper()
            if name in ("EVALSHA", "EVALSHA_RO") and len(cmd) > 1:
                name = f"EVALSHA {names.get(cmd[1].lower(), cmd[1][:8])}"
            elif name in ("FCALL", "FCALL_RO") and len(cmd) > 1:
                name = f"FCALL {re.sub(r'^rollout_broker_[0-9a-f]+_', '', cmd[1])}"
            if name in ("SLOWLOG", "CONFIG"):
                continue
            per_cmd[name].append(int(e["duration"]))
        ops = max(1, g.ops)
        print(
            f"workload: {args.workload}{'' if args.workload == 'work' else ' ' + args.fmt}, "
            f"{g.ops} operations in {g.span:.1f} s "
            f"({g.rate:,.0f} {'prompts' if args.workload == 'work' else 'rollouts'}/s, "
            f"{g.ops / g.span:,.1f} ops/s)"
        )
        print(
            f"server CPU per operation: uvicorn {cpu_b / ops * 1e3:.2f} ms, "
            f"redis {cpu_r / ops * 1e3:.2f} ms"
        )
        wall_ms = g.span / ops * 1e3
        print(f"wall time per operation (client view): {wall_ms:.2f} ms")
        print(f"\nRedis command time per operation (SLOWLOG of commands ≥ {args.slowlog_us} µs):")
        for name, durs in sorted(per_cmd.items(), key=lambda kv: -sum(kv[1])):
            print(
                f"  {sum(durs) / ops:9.0f} µs/op  {len(durs) / ops:6.1f} calls/op  "
                f"{sum(durs) / len(durs):8.0f} µs/call  {name}"
            )
        print()
        print(summarise_stacks(stacks, args.top))
        if out_dir:
            print(f"\nraw stacks kept in {stacks} (collapsed format, e.g. for flamegraph.pl)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
