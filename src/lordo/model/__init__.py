from .gpt import GPT, GPTConfig, build_model
from .params import DEFAULT_RULES, ParamRule, format_groups, group_parameters, param_groups

__all__ = ["GPT", "GPTConfig", "build_model", "ParamRule", "DEFAULT_RULES", "group_parameters", "format_groups", "param_groups"]
