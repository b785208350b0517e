"""The engine: one thread turning the serving loop — requests and their sequences (`sequence`),
sampling parameters (`params`), the scheduler that picks each step's work under a token budget
(`scheduler`), the step's flat batch (`step_batch`) and the runner that hands it to the kernels
(`runner`), the sampler (`sampling`), stop checks and incremental detokenization
(`output_processor`, `detokenizer`), the per-request output streams (`outputs`) and the loop itself
(`engine`).

The engine imports the kernels and the model; nothing below it imports the engine.
"""
