"""The load story: sources, the plan, the readers, replicated restores, lazy
leaves, trees rebuilt without their code, `Checkpoint`.
"""
