"""Access control: who may call what (``policy``), the tokens that say who a caller is
(``tokens``), the request guard that applies both (``guard``) and the audit log of operator
actions (``audit``). Nothing here knows the broker's storage or the accounting."""
