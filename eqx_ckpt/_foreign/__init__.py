"""Other formats: safetensors files and Hugging Face directories of them, orbax
checkpoints, PyTorch layouts of `eqx.nn` layers.
"""
