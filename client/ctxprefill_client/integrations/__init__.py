"""Model integrations: ctxprefill inside a model's own forward pass (docs/INTEGRATION.md).

- :mod:`ctxprefill_client.integrations.transformers_deepseek`: chunked prefill of a
  transformers ``DeepseekV3ForCausalLM`` (DeepSeek-V3 / Kimi-K2 MLA) whose attention over
  earlier chunks comes from ctxprefill. Needs torch and transformers, imported when that
  module is; importing this package imports neither.
"""

__all__: list[str] = []
