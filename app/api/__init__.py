"""HTTP routers: parse the request, call the broker, shape the response. No rules here."""
