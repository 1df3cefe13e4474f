"""automodel.data: offline tokenizer and corpora, text/instruction datasets, Hugging Face ``datasets``
sources (cached or streamed), cp-aware collation, and a deterministic, resumable dp sampler. See
docs/data.md."""

from automodel.data.collator import Collator, collate, count_label_tokens
from automodel.data.dataloader import ResumableDataLoader, build_dataloader
from automodel.data.examples import IGNORE_INDEX
from automodel.data.hf_dataset import HFDataset
from automodel.data.instruction_dataset import InstructionDataset
from automodel.data.packing import SEQ_LENS_PAD
from automodel.data.sampler import DistributedBatchSampler
from automodel.data.streaming import StreamingDataLoader, StreamingHFDataset
from automodel.data.text_dataset import TextDataset
from automodel.data.tokenizer import default_tokenizer_dir, load_tokenizer

__all__ = [
    "IGNORE_INDEX",
    "SEQ_LENS_PAD",
    "Collator",
    "DistributedBatchSampler",
    "HFDataset",
    "InstructionDataset",
    "ResumableDataLoader",
    "StreamingDataLoader",
    "StreamingHFDataset",
    "TextDataset",
    "build_dataloader",
    "collate",
    "count_label_tokens",
    "default_tokenizer_dir",
    "load_tokenizer",
]
