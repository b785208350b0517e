"""The model: everything a model file or directory holds, read into memory — hyperparameters
(`config`), the storage types of quantized tensors and their numpy dequantization (`quant`), the
weights as stored (`weights`), the GGUF and safetensors loaders, the tokenizer, the chat template,
the catalog of named models (which packages ship their files; `treadle pull`), and the registry
that turns a name or a path into a `Model`.

It imports nothing from the rest of decoding: the kernels read its storage types and weights, the
engine its tokenizer. (The storage types live here rather than with the kernels because the loaders
must know every type's block layout to read a file, and loading must not depend on the kernels.)
"""
