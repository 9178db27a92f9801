"""Sources: where a load reads leaves from (a checkpoint, another format, the
Hub, a fine-tune's base), and the one verifying reader of their bytes.
"""
