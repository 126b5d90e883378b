"""The executor and its workers: one worker per GPU (rank), each owning a model shard, its KV
cache shard, CUDA graphs and the sampler.

Takes one `StepPlan` per step and answers with the sampled tokens. Imports the common modules
and `kernels`; never the engine or the HTTP edge.
"""
