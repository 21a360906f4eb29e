"""tokenweir: an LLM serving engine built around a token-budget scheduler."""

from tokenweir.request import SamplingParams
from tokenweir.outputs import CompletionOutput, RequestOutput

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch; import it lazily so `tokenweir.core` stays torch-free to import.
    if name == "LLM":
        from tokenweir.engine.llm import LLM
        return LLM
    raise AttributeError(name)
