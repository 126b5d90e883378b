"""The HTTP edge: LMI / TGI / OpenAI wire formats, the Flask app and gunicorn's entry point.

Imports the engine package (through its client interface) and the common modules; never the
executor: nothing here touches a device.
"""
