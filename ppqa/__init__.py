"""ppqa: answer many questions about one long document with a local LLM, fast."""

__version__ = "0.1.0"
