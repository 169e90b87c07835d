"""A real fast tokenizer with no download (this machine reaches no model hub): byte-level BPE without merges, every
byte a token, under the special tokens and chat template a test's model expects."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast


def byte_tokenizer(chat_template: str, eos_token: str, pad_token: str) -> PreTrainedTokenizerFast:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    core = Tokenizer(models.BPE(vocab={char: i for i, char in enumerate(alphabet)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=eos_token, pad_token=pad_token)
    tokenizer.chat_template = chat_template
    return tokenizer
