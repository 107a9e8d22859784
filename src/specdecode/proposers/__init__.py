"""Proposers: anything that proposes draft tokens for the target to verify.

One file per proposer; :mod:`.base` holds the contract (:class:`Proposer`) and the types
they exchange with the engine. A new method is a new file here plus one entry in
:mod:`specdecode.methods`.
"""

from .base import DraftOutput, Forecast, Proposer, RequestState
from .cross_tokenizer import CrossTokenizerProposer
from .draft_model import DraftModelProposer
from .eagle3 import Eagle3Proposer
from .hybrid import HybridProposer, HybridTuning
from .medusa import MedusaProposer
from .prediction import PredictionProposer, prediction_usage
from .prompt_lookup import PromptLookupProposer
from .suffix import ContinuationCounts, SuffixProposer

__all__ = ["ContinuationCounts", "CrossTokenizerProposer", "DraftModelProposer", "DraftOutput", "Eagle3Proposer", "Forecast", "HybridProposer",
           "HybridTuning", "MedusaProposer", "PredictionProposer", "PromptLookupProposer", "Proposer", "RequestState", "SuffixProposer",
           "prediction_usage"]
