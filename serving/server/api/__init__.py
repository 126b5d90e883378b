"""The HTTP APIs of the edge, one module (or small package) each: its request parsing, its wire
formats (one `Formatter` subclass per format) and its routes (a Flask blueprint, registered by
`serving/server/app.py`). What they share is one level up: `protocol` (the parsed request and
the typed getters), `formatters` (the format interface, `Result`), `errors`, `edge` (running a
request: readiness, body, adapters, the runner, the error answer).
"""
