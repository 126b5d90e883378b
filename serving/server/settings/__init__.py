"""The edge's settings and downloads: the LMI environment / serving.properties keys (`config_keys`),
`ServingConfig` built from them (`config`), the adapter allow-list, and fetching the model and
adapters from S3 or the hub into local dirs (`model_source`, `adapter_source`, `download_paths`).

Read by the rest of the edge and the container scripts; imports no other part of the edge, nor
the engine or executor (`serving.engine_config` and `serving.checkpoint` only).
"""
