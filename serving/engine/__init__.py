"""The engine: requests, the rolling-batch scheduler, KV block bookkeeping, detokenization.

It plans each step as a by-value `StepPlan` and hands it to an executor (`serving.executor`);
it never touches a tensor. Imports the executor's hand-off types and the common modules; never
the HTTP edge.
"""
