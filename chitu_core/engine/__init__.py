"""The engine: sequences, paged KV blocks, scheduling, the model runner and the offline ``LLM`` API.

A step: the scheduler picks sequences and how many new tokens each computes,
the block manager gives them KV blocks, the model runner builds the step's
inputs once (vectorized), runs the model through the paged KV cache, samples on
the device and copies the results to the host once; finished sequences return
their blocks.
"""
