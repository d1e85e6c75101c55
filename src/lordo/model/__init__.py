from .gpt import GPT, GPTConfig
from .params import ParamRule, DEFAULT_RULES, group_parameters, format_groups

__all__ = ["GPT", "GPTConfig", "ParamRule", "DEFAULT_RULES", "group_parameters", "format_groups"]
