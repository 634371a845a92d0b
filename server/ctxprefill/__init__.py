"""ctxprefill: chunked-context MLA prefill attention over a paged latent cache."""

__version__ = "0.1.0"
