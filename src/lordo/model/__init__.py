from .gpt import GPT, GPTConfig
from .params import DEFAULT_RULES, ParamRule, format_groups, group_parameters, param_groups

__all__ = ["GPT", "GPTConfig", "ParamRule", "DEFAULT_RULES", "group_parameters", "format_groups", "param_groups"]
