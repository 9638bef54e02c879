"""Local update rules of the spec (rules.py) and the single-process oracle (simulate.py)."""
from .rules import GLU_STATES, RULES, LocalRule, flatten_state, make_local_rule

__all__ = ['GLU_STATES', 'RULES', 'LocalRule', 'flatten_state', 'make_local_rule']
