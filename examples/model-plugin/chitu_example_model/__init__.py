"""chitu-example-model: an example out-of-tree model plugin for chitu-core (see docs/writing-a-model.md).

It serves one architecture that chitu-models does not: IBM Granite (``GraniteForCausalLM``), built
on the Llama decoder of ``chitu_models.llama``.
"""
