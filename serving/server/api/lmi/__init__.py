"""LMI's API (`POST /invocations`) and TGI's (`POST /`, `/generate`, `/generate_stream`), which
share LMI's `parameters` and its records: `request` parses, `formats` writes, `routes` serves."""
