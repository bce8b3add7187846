"""deploy/ against the broker it watches: every metric and label that an alerting rule or a
dashboard query names is one that ``GET /metrics`` serves (``app.metrics.CATALOGUE``), the
files parse and hang together, and, where ``promtool`` is installed, each rule fires on the
synthetic series of ``deploy/prometheus/alerts_test.yml`` and stays quiet where it should.

The PromQL is read by a small tokenizer and parser below, not by pattern matching on names:
strings, ranges (``[5m]``, ``[$__rate_interval]``), durations, numbers, function names and
keywords are tokens of their own, so a word inside a label value is never taken for a metric,
and the labels each sub-expression carries are followed through aggregations, functions and
vector matching. The last tests show it reporting what it exists to report."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from app.metrics import CATALOGUE

REPO = Path(__file__).resolve().parents[1]
PROMETHEUS = REPO / "deploy" / "prometheus"
ALERTS = PROMETHEUS / "alerts.yml"
ALERTS_TEST = PROMETHEUS / "alerts_test.yml"
SCRAPE_CONFIG = PROMETHEUS / "prometheus.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "rollout-broker.json"

JOB = "rollout-broker"
TARGET_LABELS = frozenset({"job", "instance"})
"""Labels Prometheus attaches to every series it scrapes."""

LABEL_VALUES: Mapping[str, frozenset[str]] = {
    "outcome": frozenset({"leased", "acked", "nacked", "expired"}),
    "state": frozenset({"queued", "in_flight", "done", "failed", "skipped"}),
    "pool": frozenset({"easy", "normal", "hard"}),
    "status_class": frozenset({"1xx", "2xx", "3xx", "4xx", "5xx", "other"}),
}
"""The values of the enumerated labels (app/metrics/catalogue.py): a matcher on any other value
selects nothing, silently, so an alert on it would never fire."""
METRIC_LABEL_VALUES: Mapping[tuple[str, str], frozenset[str]] = {
    ("rollout_broker_consumer_items", "state"): frozenset(
        {"delivered", "acked", "pending", "dropped"}
    ),
}
"""Where one metric's label has values of its own, not those of LABEL_VALUES."""

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def series_catalogue() -> dict[str, frozenset[str]]:
    """Every series name a scrape of the broker yields, with its labels: a histogram family
    ``x`` is ``x_bucket`` (with ``le``), ``x_sum`` and ``x_count``; ``up`` is Prometheus's."""
    out = {"up": TARGET_LABELS}
    for spec in CATALOGUE:
        labels = TARGET_LABELS | frozenset(spec.labels)
        if spec.kind == "histogram":
            out[f"{spec.name}_bucket"] = labels | {"le"}
            out[f"{spec.name}_sum"] = labels
            out[f"{spec.name}_count"] = labels
        else:
            out[spec.name] = labels
    return out


SERIES = series_catalogue()


# -- PromQL: tokens ------------------------------------------------------------------------


class PromQLError(ValueError):
    """An expression this reader cannot parse (so it cannot vouch for it either)."""


@dataclass(frozen=True, slots=True)
class Token:
    kind: str  # string, range, duration, number, ident, op
    text: str


_DURATION = r"(?:\d+(?:ms|[smhdwy]))+"
_VARIABLE = r"\$\w+|\$\{\w+\}"  # a Grafana variable: $__rate_interval, ${run}
_TOKENS = re.compile(
    rf"""
      (?P<space>\s+|\#[^\n]*)
    | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
    | (?P<range>\[[^\]]*\])
    | (?P<duration>{_DURATION})(?![\w.])
    | (?P<number>0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
    | (?P<ident>[A-Za-z_:][\w:]*)
    | (?P<op>==|!=|>=|<=|=~|!~|[-+*/%^<>=(){{}},@])
    """,
    re.VERBOSE,
)
_RANGE = re.compile(
    rf"\[\s*(?:{_DURATION}|{_VARIABLE})\s*(?::\s*(?:{_DURATION}|{_VARIABLE})?\s*)?\]"
)


def tokenize(expr: str) -> list[Token]:
    """The expression's tokens, whitespace and comments left out. A range must hold a duration
    or a Grafana variable (a subquery's ``[1h:5m]`` too); anything unknown is an error."""
    tokens: list[Token] = []
    pos = 0
    while pos < len(expr):
        m = _TOKENS.match(expr, pos)
        if m is None:
            raise PromQLError(f"cannot read {expr[pos : pos + 20]!r} at {pos}")
        kind = m.lastgroup
        assert kind is not None
        if kind == "range" and not _RANGE.fullmatch(m.group()):
            raise PromQLError(f"not a range: {m.group()!r}")
        if kind != "space":
            tokens.append(Token(kind, m.group()))
        pos = m.end()
    return tokens


# -- PromQL: the labels each part carries -------------------------------------------------

Labels = frozenset[str] | None
"""The labels of a vector expression's series; None for a scalar or a string."""

ANY: frozenset[str] = frozenset({"*"})
"""The labels of something unknown (an unknown metric): anything is allowed, so one mistake
is reported once, not again at every clause above it."""


def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


AGGREGATIONS = _words(
    "sum min max avg group stddev stdvar count count_values bottomk topk quantile limitk "
    "limit_ratio"
)
KEEPS_LABELS = frozenset({"topk", "bottomk", "limitk", "limit_ratio"})
FUNCTIONS = _words(
    """abs absent absent_over_time acos acosh asin asinh atan atanh avg_over_time ceil changes
    clamp clamp_max clamp_min cos cosh count_over_time day_of_month day_of_week day_of_year
    days_in_month deg delta deriv exp floor histogram_quantile holt_winters hour idelta increase
    irate label_join label_replace last_over_time ln log10 log2 max_over_time min_over_time
    minute month pi predict_linear present_over_time quantile_over_time rad rate resets round
    scalar sgn sin sinh sort sort_desc sqrt stddev_over_time stdvar_over_time sum_over_time tan
    tanh time timestamp vector year"""
)
SCALAR_FUNCTIONS = frozenset({"scalar", "time", "pi"})
SET_OPERATORS = frozenset({"and", "or", "unless"})
PRECEDENCE: Mapping[str, int] = {
    "or": 1,
    "and": 2,
    "unless": 2,
    **dict.fromkeys(("==", "!=", "<", "<=", ">", ">="), 3),
    "+": 4,
    "-": 4,
    **dict.fromkeys(("*", "/", "%", "atan2"), 5),
    "^": 6,
}
KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right", "bool"})


def has(labels: frozenset[str], label: str) -> bool:
    return "*" in labels or label in labels


def shown(labels: Labels) -> str:
    return "scalar" if labels is None else "{" + ", ".join(sorted(labels - ANY)) + "}"


@dataclass(frozen=True, slots=True)
class Selector:
    metric: str
    matchers: Mapping[str, tuple[str, str]]  # label -> (operator, value)


@dataclass(slots=True)
class Analysis:
    labels: Labels = None  # of the whole expression's result
    selectors: list[Selector] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def metrics(self) -> set[str]:
        return {s.metric for s in self.selectors}


@dataclass(frozen=True, slots=True)
class Matching:
    kind: str | None  # on, ignoring
    labels: frozenset[str]
    group: str | None  # group_left, group_right
    include: frozenset[str]


class _Parser:
    """Recursive descent over the tokens, by PromQL's operator precedence. Each rule returns
    the labels of its result and notes what does not exist: metrics, matcher labels and
    values, grouping and matching labels, functions; and binary operations whose sides can
    never match."""

    def __init__(self, expr: str, series: Mapping[str, frozenset[str]]) -> None:
        self.tokens = tokenize(expr)
        self.i = 0
        self.series = series
        self.out = Analysis()

    def parse(self) -> Analysis:
        self.out.labels = self.expression(1)
        if self.i != len(self.tokens):
            raise PromQLError(f"unexpected {self.tokens[self.i].text!r}")
        return self.out

    def problem(self, text: str) -> None:
        self.out.problems.append(text)

    # tokens

    def peek(self) -> Token | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self) -> Token:
        tok = self.peek()
        if tok is None:
            raise PromQLError("unexpected end")
        self.i += 1
        return tok

    def at(self, *texts: str) -> bool:
        tok = self.peek()
        return tok is not None and tok.kind in ("op", "ident") and tok.text in texts

    def expect(self, text: str) -> None:
        tok = self.take()
        if tok.text != text:
            raise PromQLError(f"expected {text!r}, got {tok.text!r}")

    def separator(self, closer: str) -> None:
        """After a list's element: a comma, or the end of the list."""
        if self.at(","):
            self.i += 1
        elif not self.at(closer):
            raise PromQLError(f"expected ',' or {closer!r}")

    def names(self) -> frozenset[str]:
        """``(a, b)``: a list of label names."""
        self.expect("(")
        out = set()
        while not self.at(")"):
            tok = self.take()
            if tok.kind != "ident":
                raise PromQLError(f"not a label name: {tok.text!r}")
            out.add(tok.text)
            self.separator(")")
        self.i += 1
        return frozenset(out)

    # grammar

    def expression(self, min_precedence: int) -> Labels:
        left = self.unary()
        while (tok := self.peek()) is not None and tok.text in PRECEDENCE:
            precedence = PRECEDENCE[tok.text]
            if tok.kind not in ("op", "ident") or precedence < min_precedence:
                break
            self.i += 1
            if self.at("bool"):
                self.i += 1
            matching = self.matching()
            right = self.expression(precedence if tok.text == "^" else precedence + 1)
            left = self.combine(tok.text, matching, left, right)
        return left

    def unary(self) -> Labels:
        if self.at("-", "+"):
            self.i += 1
            return self.unary()
        labels = self.primary()
        while (tok := self.peek()) is not None:
            if tok.kind == "range":
                self.i += 1
            elif self.at("offset"):
                self.i += 1
                if self.at("-"):
                    self.i += 1
                if self.take().kind != "duration":
                    raise PromQLError("offset without a duration")
            elif self.at("@"):
                self.i += 1
                at = self.take()
                if at.text in ("start", "end"):
                    self.expect("(")
                    self.expect(")")
                elif at.kind != "number":
                    raise PromQLError(f"@ {at.text}")
            else:
                break
        return labels

    def primary(self) -> Labels:
        tok = self.take()
        if tok.kind in ("number", "string"):
            return None
        if tok.text == "(":
            inner = self.expression(1)
            self.expect(")")
            return inner
        if tok.kind != "ident":
            raise PromQLError(f"unexpected {tok.text!r}")
        if tok.text in AGGREGATIONS and self.at("(", "by", "without"):
            return self.aggregation(tok.text)
        if self.at("("):
            return self.call(tok.text)
        if tok.text.lower() in ("inf", "nan"):
            return None
        if tok.text in KEYWORDS or tok.text in PRECEDENCE or tok.text == "offset":
            raise PromQLError(f"{tok.text!r} where a value belongs")
        return self.selector(tok.text)

    def selector(self, metric: str) -> frozenset[str]:
        labels = self.series.get(metric)
        if labels is None:
            self.problem(f"unknown metric {metric}")
            labels = ANY
        matchers: dict[str, tuple[str, str]] = {}
        if self.at("{"):
            self.i += 1
            while not self.at("}"):
                label, op, value = self.take(), self.take(), self.take()
                if label.kind != "ident" or op.text not in ("=", "!=", "=~", "!~"):
                    raise PromQLError(f"not a label matcher: {label.text}{op.text}")
                if value.kind != "string":
                    raise PromQLError(f"a label value must be a string: {value.text}")
                matchers[label.text] = (op.text, value.text[1:-1])
                self.separator("}")
            self.i += 1
        for label, (op, value) in matchers.items():
            if label != "__name__" and not has(labels, label):
                self.problem(f"{metric} has no label {label} (its labels: {shown(labels)})")
            self.check_values(metric, label, op, value)
        self.out.selectors.append(Selector(metric, matchers))
        return labels

    def check_values(self, metric: str, label: str, op: str, value: str) -> None:
        known = METRIC_LABEL_VALUES.get((metric, label), LABEL_VALUES.get(label))
        if known is None or "$" in value:
            return
        if op in ("=", "!="):
            values = [value]
        elif re.fullmatch(r"\w+(\|\w+)*", value):  # a plain alternation: a|b
            values = value.split("|")
        else:
            return
        for v in values:
            if v not in known:
                self.problem(f"{metric}: {label} is never {v!r} (it is one of {sorted(known)})")

    def aggregation(self, name: str) -> Labels:
        grouping = (self.take().text, self.names()) if self.at("by", "without") else None
        self.expect("(")
        args = [self.expression(1)]
        while self.at(","):
            self.i += 1
            args.append(self.expression(1))
        self.expect(")")
        if grouping is None and self.at("by", "without"):
            grouping = (self.take().text, self.names())
        vector = args[-1]
        if vector is None:
            raise PromQLError(f"{name} over a scalar")
        if grouping is None:
            result = vector if name in KEEPS_LABELS else frozenset()
        else:
            clause, names = grouping
            for label in sorted(names):
                if not has(vector, label):
                    self.problem(
                        f"{name} {clause} ({label}): {label} is not a label of what it "
                        f"aggregates {shown(vector)}"
                    )
            result = names if clause == "by" else vector - names
            if name in KEEPS_LABELS:
                result = vector
        return result | ANY if name == "count_values" else result

    def call(self, name: str) -> Labels:
        if name not in FUNCTIONS:
            self.problem(f"unknown function {name}()")
        self.expect("(")
        args: list[Labels] = []
        while not self.at(")"):
            args.append(self.expression(1))
            self.separator(")")
        self.i += 1
        vectors = [a for a in args if a is not None]
        if name in SCALAR_FUNCTIONS:
            return None
        if name == "histogram_quantile":
            if len(args) != 2 or args[1] is None:
                raise PromQLError("histogram_quantile(φ, buckets)")
            if not has(args[1], "le"):
                self.problem(f"histogram_quantile over series without le {shown(args[1])}")
            return args[1] - {"le"}
        if name in ("label_replace", "label_join"):
            return (vectors[0] if vectors else frozenset()) | ANY
        if name in ("absent", "absent_over_time", "vector"):
            return frozenset()
        return vectors[0] if vectors else frozenset()

    def matching(self) -> Matching:
        kind, labels = None, frozenset[str]()
        if self.at("on", "ignoring"):
            kind, labels = self.take().text, self.names()
        group, include = None, frozenset[str]()
        if self.at("group_left", "group_right"):
            group = self.take().text
            if self.at("("):
                include = self.names()
        return Matching(kind, labels, group, include)

    def combine(self, op: str, m: Matching, left: Labels, right: Labels) -> Labels:
        if left is None or right is None:
            if op in SET_OPERATORS:
                raise PromQLError(f"{op!r} between a scalar and a vector")
            return right if left is None else left
        for label in sorted(m.labels):
            if m.kind == "on":
                for side, labels in (("left", left), ("right", right)):
                    if not has(labels, label):
                        self.problem(
                            f"{op} on ({label}): {label} is not a label of its {side} side "
                            f"{shown(labels)}"
                        )
            elif not (has(left, label) or has(right, label)):
                self.problem(f"{op} ignoring ({label}): no side has {label}")
        if m.group is not None:
            many, one = (left, right) if m.group == "group_left" else (right, left)
            for label in sorted(m.include):
                if not has(one, label):
                    self.problem(f"{m.group} ({label}): {label} is not a label of the one side")
            return many | m.include
        if m.kind == "on":
            keys_left = keys_right = m.labels
        else:
            keys_left, keys_right = left - m.labels, right - m.labels
        if op != "or" and "*" not in keys_left | keys_right and keys_left != keys_right:
            self.problem(
                f"{op!r} matches series on all their labels, and its sides carry different "
                f"ones ({shown(left)} against {shown(right)}): nothing would match; aggregate "
                f"them or say on (...)"
            )
        if op in SET_OPERATORS:
            return left | right if op == "or" else left
        return m.labels if m.kind == "on" else keys_left


def analyse(expr: str, series: Mapping[str, frozenset[str]] = SERIES) -> Analysis:
    return _Parser(expr, series).parse()


# -- the files -----------------------------------------------------------------------------


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def alert_rules() -> list[dict[str, Any]]:
    doc = load_yaml(ALERTS)
    return [rule for group in doc["groups"] for rule in group["rules"]]


def dashboard() -> dict[str, Any]:
    out: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return out


def all_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, those inside collapsed rows included."""
    for panel in panels:
        yield panel
        yield from all_panels(panel.get("panels", []))


def dashboard_targets() -> list[tuple[str, dict[str, Any]]]:
    return [
        (f"{panel['title']}/{target['refId']}", target)
        for panel in all_panels(dashboard()["panels"])
        for target in panel.get("targets", [])
    ]


_LABEL_REF = re.compile(r"\$labels\.(\w+)")
_LEGEND_REF = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def test_the_catalogue_names_what_a_scrape_shows() -> None:
    """The interface the checks below rely on: counters end in _total, histograms are named
    without their suffixes, and no metric has a label Prometheus sets itself (``job`` and
    ``instance`` would be renamed ``exported_*`` at the scrape, ``le`` is the buckets')."""
    assert CATALOGUE
    names = [spec.name for spec in CATALOGUE]
    assert len(names) == len(set(names))
    for spec in CATALOGUE:
        assert spec.name.startswith("rollout_broker_"), spec.name
        assert spec.kind in ("counter", "gauge", "histogram"), spec
        assert spec.name.endswith("_total") == (spec.kind == "counter"), spec.name
        assert not spec.name.endswith(("_bucket", "_sum", "_count", "_created")), spec.name
        assert not (set(spec.labels) & (TARGET_LABELS | {"le"})), spec


# -- alerting rules ------------------------------------------------------------------------


def test_alert_rules_are_complete() -> None:
    doc = load_yaml(ALERTS)
    assert [g["name"] for g in doc["groups"]] == ["rollout-broker"]
    rules = alert_rules()
    names = [rule["alert"] for rule in rules]
    assert len(names) == len(set(names)), names
    for rule in rules:
        assert set(rule) == {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        assert re.fullmatch(r"\d+[smh]", rule["for"]), rule
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), rule
        annotations = rule["annotations"]
        assert {"summary", "description", "runbook"} <= set(annotations), rule["alert"]
        assert all(isinstance(v, str) and v.strip() for v in annotations.values()), rule


@pytest.mark.parametrize("rule", alert_rules(), ids=lambda rule: rule["alert"])
def test_alert_expression_names_served_metrics_and_labels(rule: dict[str, Any]) -> None:
    found = analyse(rule["expr"])
    assert not found.problems, found.problems
    assert found.metrics, "an expression that reads no metric"
    assert found.labels is not None
    # The annotations may only use labels the alert carries.
    used = {m for text in rule["annotations"].values() for m in _LABEL_REF.findall(text)}
    assert used <= found.labels, f"{sorted(used - found.labels)} not among {shown(found.labels)}"
    if "run" in found.labels:
        # One alert per run, not one per scraped process; and it says which run.
        assert "instance" not in found.labels, shown(found.labels)
        assert "$labels.run" in rule["annotations"]["summary"]
        assert "$labels.run" in rule["annotations"]["description"]
    else:
        summary = rule["annotations"]["summary"]
        assert _LABEL_REF.search(summary) or "$value" in summary, "says which process"


_DOC_LINK = re.compile(r"([\w./-]+\.md)(?:#([\w-]+))?")


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_runbook_hints_point_at_existing_sections() -> None:
    pointers = 0
    for rule in alert_rules():
        for path, anchor in _DOC_LINK.findall(rule["annotations"]["runbook"]):
            target = REPO / path
            assert target.is_file(), f"{rule['alert']}: {path}"
            pointers += 1
            if anchor:
                headings = re.findall(r"^#+ (.+)$", target.read_text(), re.MULTILINE)
                assert anchor in {_slug(h) for h in headings}, f"{rule['alert']}: {path}#{anchor}"
    assert pointers >= len(alert_rules())


def test_every_alert_has_a_promtool_case_that_fires() -> None:
    """Read without promtool: the unit tests load these rules and make each one fire."""
    doc = load_yaml(ALERTS_TEST)
    assert doc["rule_files"] == [ALERTS.name]
    fired = {
        case["alertname"]
        for test in doc["tests"]
        for case in test["alert_rule_test"]
        if case.get("exp_alerts")
    }
    quiet = {
        case["alertname"]
        for test in doc["tests"]
        for case in test["alert_rule_test"]
        if not case.get("exp_alerts")
    }
    names = {rule["alert"] for rule in alert_rules()}
    assert fired == names, f"no firing case: {sorted(names - fired)}"
    assert quiet == names, f"no quiet case: {sorted(names - quiet)}"
    for test in doc["tests"]:
        for series in test["input_series"]:
            found = analyse(series["series"])
            assert not found.problems, (series["series"], found.problems)


PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed")


def promtool(*args: str, cwd: Path = REPO) -> str:
    assert PROMTOOL is not None
    run = subprocess.run(
        [PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


@needs_promtool
def test_promtool_checks_the_rules() -> None:
    out = promtool("check", "rules", str(ALERTS))
    assert f"SUCCESS: {len(alert_rules())} rules found" in out


@needs_promtool
def test_promtool_unit_tests_of_the_rules() -> None:
    """Each alert fires on its synthetic series (served by two processes: once per run) and
    not on its neighbours, such as a run with rollouts buffered whose acks keep flowing."""
    promtool("test", "rules", str(ALERTS_TEST))


@needs_promtool
def test_promtool_checks_the_scrape_config(tmp_path: Path) -> None:
    """promtool wants the token file to exist: a copy of the config points at one."""
    config = load_yaml(SCRAPE_CONFIG)
    token = tmp_path / "token"
    token.write_text("secret\n")
    for job in config["scrape_configs"]:
        job["authorization"]["credentials_file"] = str(token)
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    shutil.copy(ALERTS, tmp_path / ALERTS.name)
    promtool("check", "config", "prometheus.yml", cwd=tmp_path)


# -- scrape config -------------------------------------------------------------------------


def test_scrape_config_scrapes_every_process_with_a_token_file() -> None:
    config = load_yaml(SCRAPE_CONFIG)
    assert config["rule_files"] == [ALERTS.name]
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == JOB]
    assert job["metrics_path"] == "/metrics"
    assert job["authorization"]["type"] == "Bearer"
    assert "credentials_file" in job["authorization"]
    assert "credentials" not in job["authorization"], "a secret inline in the config"
    assert len(job["static_configs"][0]["targets"]) > 1, "one target per API process"
    # The rules and the dashboard look for this job's targets.
    jobs = set()
    for expr in [r["expr"] for r in alert_rules()] + [t["expr"] for _, t in dashboard_targets()]:
        for selector in analyse(expr).selectors:
            if "job" in selector.matchers:
                jobs.add(selector.matchers["job"])
    assert jobs == {("=", JOB)}


# -- dashboard -----------------------------------------------------------------------------


def _datasources(node: Any, where: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "datasource":
                yield where, value
            else:
                yield from _datasources(value, f"{where}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _datasources(value, f"{where}/{i}")


def test_dashboard_is_tidy() -> None:
    board = dashboard()
    assert 36 <= board["schemaVersion"] <= 41
    assert board["uid"] == "rollout-broker"
    panels = list(all_panels(board["panels"]))
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    assert panels[0]["type"] == "row"
    # The grid: 24 columns, no two panels on one cell.
    taken: dict[tuple[int, int], str] = {}
    for panel in panels:
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["w"] > 0 and pos["x"] + pos["w"] <= 24, panel["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in taken, f"{panel['title']} over {taken[(x, y)]}"
                taken[(x, y)] = panel["title"]
    for panel in panels:
        if panel["type"] == "row":
            continue
        assert panel["targets"], panel["title"]
        assert panel.get("description"), panel["title"]
        assert panel["fieldConfig"]["defaults"]["unit"] in (
            "s",
            "short",
            "percentunit",
            "reqps",
        ), panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]


def test_dashboard_variables() -> None:
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    assert set(variables) == {"datasource", "run"}
    source = variables["datasource"]
    assert (source["type"], source["query"]) == ("datasource", "prometheus")
    run = variables["run"]
    assert run["type"] == "query" and run["multi"] and run["includeAll"]
    m = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", run["query"])
    assert m is not None, run["query"]
    metric, label = m.groups()
    assert label in SERIES[metric], f"{metric} has no label {label}"


def test_every_datasource_reference_is_the_variable() -> None:
    """Whichever Prometheus the importer picks, every query goes to it."""
    board = dashboard()
    for where, ref in _datasources(board):
        assert ref == DATASOURCE, where
    for panel in all_panels(board["panels"]):
        if panel["type"] != "row":
            assert panel["datasource"] == DATASOURCE, panel["title"]
            assert all(t["datasource"] == DATASOURCE for t in panel["targets"]), panel["title"]
    run = next(v for v in board["templating"]["list"] if v["name"] == "run")
    assert run["datasource"] == DATASOURCE


@pytest.mark.parametrize(
    "target", [t for _, t in dashboard_targets()], ids=[i for i, _ in dashboard_targets()]
)
def test_dashboard_query_names_served_metrics_and_labels(target: dict[str, Any]) -> None:
    found = analyse(target["expr"])
    assert not found.problems, found.problems
    assert found.metrics, "a query that reads no metric"
    assert found.labels is not None
    legend = set(_LEGEND_REF.findall(target.get("legendFormat", "")))
    assert legend <= found.labels, f"legend {sorted(legend)} of a result {shown(found.labels)}"
    # Every per-run figure follows the run picker; none is summed over processes.
    for selector in found.selectors:
        if "run" in SERIES[selector.metric]:
            assert selector.matchers.get("run") == ("=~", "$run"), selector
    if "run" in {label for s in found.selectors for label in SERIES[s.metric]}:
        assert "instance" not in found.labels


def test_dashboard_shows_every_metric() -> None:
    """A metric added to the catalogue gets a panel (or this test says which one lacks it)."""
    used = {m for _, t in dashboard_targets() for m in analyse(t["expr"]).metrics}
    families = {
        spec.name: {f"{spec.name}{s}" for s in ("_bucket", "_sum", "_count")}
        if spec.kind == "histogram"
        else {spec.name}
        for spec in CATALOGUE
    }
    missing = sorted(name for name, series in families.items() if not series & used)
    assert not missing, f"no panel shows {missing}"


# -- the reader itself ---------------------------------------------------------------------


def test_the_check_reports_a_misspelt_metric_and_an_unknown_label() -> None:
    expr = (
        'rate(rollout_broker_rollouts_recieved_total{run=~"$run"}[5m])'
        '\n  / on (run) max by (run) (rollout_broker_rollouts_buffered{runn="r1"})'
    )
    found = analyse(expr)
    assert found.problems == [
        "unknown metric rollout_broker_rollouts_recieved_total",
        "rollout_broker_rollouts_buffered has no label runn (its labels: {instance, job, run})",
    ]


@pytest.mark.parametrize(
    ("expr", "problem"),
    [
        # a counter without its suffix, a histogram family without _bucket
        ("rate(rollout_broker_samples_consumed[5m])", "unknown metric"),
        ("rate(rollout_broker_sample_lag_versions[5m])", "unknown metric"),
        # le is on the buckets only
        (
            "histogram_quantile(0.9, sum by (le) "
            "(rate(rollout_broker_sample_lag_versions_sum[5m])))",
            "sum by (le): le is not a label",
        ),
        ("histogram_quantile(0.9, rate(rollout_broker_sample_lag_versions_sum[5m]))", "without le"),
        # a grouping label the aggregated series lack, also after an inner aggregation
        ("sum by (reason) (rollout_broker_rollouts_buffered)", "sum by (reason)"),
        ("max by (run) (sum by (job) (rollout_broker_rollouts_buffered))", "max by (run)"),
        ("max by (run) (sum without (run) (rollout_broker_rollouts_buffered))", "max by (run)"),
        ("sum without (reason) (rollout_broker_rollouts_leased)", "sum without (reason)"),
        # matching labels, and sides that can never match one to one
        (
            "rollout_broker_rollouts_buffered / on (reason) rollout_broker_capacity_rollouts",
            "on (reason)",
        ),
        (
            "rollout_broker_rollouts_buffered > 0 and "
            'rate(rollout_broker_lease_rollouts_total{outcome="acked"}[5m]) == 0',
            "nothing would match",
        ),
        (
            "sum by (run) (rollout_broker_rollouts_buffered) / rollout_broker_capacity_rollouts",
            "nothing would match",
        ),
        # a label value the metric never has, a misspelt function
        ('rollout_broker_prompt_passes{state="inflight"}', "state is never 'inflight'"),
        ('rollout_broker_batches_total{outcome=~"acked|nackd"}', "outcome is never 'nackd'"),
        # a metric's own values: a consumer's item states are not prompt passes' states
        ('rollout_broker_consumer_items{state="queued"}', "state is never 'queued'"),
        ('rollout_broker_prompt_passes{state="dropped"}', "state is never 'dropped'"),
        ("rat(rollout_broker_rollouts_received_total[5m])", "unknown function rat()"),
        ('up{jbo="rollout-broker"}', "up has no label jbo"),
    ],
)
def test_the_check_reports(expr: str, problem: str) -> None:
    problems = analyse(expr).problems
    assert problems, expr
    assert any(problem in p for p in problems), problems


@pytest.mark.parametrize(
    "expr",
    [
        # names inside strings, comments and ranges are not metrics
        'rollout_broker_rollouts_retired_total{reason="rollout_broker_nothing", run!~"a|b"}',
        "rollout_broker_open_runs # rollout_broker_no_such_metric{x}",
        "max_over_time(rollout_broker_open_runs[1h:5m]) offset -5m @ end()",
        "rate(rollout_broker_tokens_wasted_total[$__rate_interval]) * 1e3 + 0x10 - Inf",
        "avg_over_time(rollout_broker_kl_max[${window}])",
        # labels followed through functions, matching and aggregation
        "histogram_quantile(0.99, sum by (route, le) "
        "(rate(rollout_broker_http_request_duration_seconds_bucket[5m])))",
        "rollout_broker_rollouts_leased / ignoring (outcome) "
        'rollout_broker_lease_rollouts_total{outcome="leased"}',
        "rollout_broker_rollouts_buffered * on (job, instance, run) group_left (reason) "
        "rollout_broker_rollouts_rejected_total",
        "topk by (run) (3, rollout_broker_lease_rollouts_total) > bool 0",
        "max by (run) (rollout_broker_kl_mean) or max by (run) (rollout_broker_kl_max)",
        "scalar(max(rollout_broker_open_runs)) * rollout_broker_rollouts_buffered",
        'absent(up{job="rollout-broker"})',
        'rollout_broker_consumer_items{state=~"acked|dropped"}',
    ],
)
def test_the_check_accepts(expr: str) -> None:
    found = analyse(expr)
    assert not found.problems, found.problems
    assert found.metrics <= set(SERIES)


@pytest.mark.parametrize(
    "expr",
    [
        "rate(rollout_broker_rollouts_received_total[5 minutes])",
        "rollout_broker_rollouts_buffered{run=r1}",
        "sum(rollout_broker_rollouts_buffered",
        "rollout_broker_rollouts_buffered $run",
        "rollout_broker_rollouts_buffered and 1",
        "sum by (run job) (rollout_broker_rollouts_buffered)",
        'rollout_broker_rollouts_buffered{run="a" job="b"}',
        "rollout_broker_rollouts_buffered @ now",
    ],
)
def test_the_check_refuses_what_it_cannot_read(expr: str) -> None:
    with pytest.raises(PromQLError):
        analyse(expr)


def test_the_tokenizer_sets_apart_what_is_not_a_name() -> None:
    tokens = tokenize('sum by (run) (rate(x{reason="a b"}[$__rate_interval] offset 1h30m)) > 0.5')
    assert [(t.kind, t.text) for t in tokens if t.kind != "op"] == [
        ("ident", "sum"),
        ("ident", "by"),
        ("ident", "run"),
        ("ident", "rate"),
        ("ident", "x"),
        ("ident", "reason"),
        ("string", '"a b"'),
        ("range", "[$__rate_interval]"),
        ("ident", "offset"),
        ("duration", "1h30m"),
        ("number", "0.5"),
    ]
