"""The load story: the plan, the readers, replicated restores, lazy leaves,
trees rebuilt without their code, `Checkpoint`.
"""
