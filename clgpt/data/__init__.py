"""The corpus: reading and checking it, the encode stage, reading encoded token files back, and batching.

Text corpus: a folder of `*.txt` (UTF-8), `*.jsonl` (one `{"text": ...}` per line) and `*.parquet` (a
`text` column) files, the Hugging Face datasets conventions. `corpus.document` says what one document
(`<s> ... </s>` in the token stream) is:
  file       a whole .txt file, or one jsonl/parquet record; newlines kept; `corpus.separator` (e.g.
             `<|endoftext|>`) splits it further, TinyStories style (each part stripped of surrounding
             whitespace);
  paragraph  the runs of non-blank lines, split at blank lines (newlines inside a paragraph kept);
  line       each non-blank line (the embedded fact corpus).
Texts are read in chunks of CHUNK_CHARS and encoded in segments cut where the pre-tokenizer would cut
anyway, so memory stays bounded on any file and the ids equal those of encoding the text whole.
Dialogs: JSON Lines, one conversation per line: `{"messages": [{"role": ..., "content": ...}, ...]}` or
`{"user": "...", "assistant": "..."}` (clgpt.text.chat.parse_dialog_line checks both).
Encoded files: a flat `uint16` (`uint32` when the vocabulary needs it) id file `X.bin`, a binary index
`X.idx` (uint64: the start of every document, then the end of the stream; for dialogs followed by the
position whose target is every dialog's first reply token) and a small JSON sidecar `X.json` (counts,
hashes; for dialogs `loss_spans`, every assistant turn's target ranges);
read back with `np.memmap`.

    corpus.py     reading the text sources and dialogs, documents, segments, the parse-time checks
    preflight.py  the corpus checks that need no tokenizer, run when the workflow is parsed
    encode.py     the encode stage's files, and reading them back (load_encoded, load_documents)
    batches.py    training and held-out batches
"""

from __future__ import annotations

from clgpt.data.batches import (
    PAD_WIDTH,
    DialogBatches,
    PretrainBatches,
    WindowSampler,
    dialog_batches,
    dialog_rows,
    pad_dialogs,
    text_batches,
)
from clgpt.data.corpus import (
    CHUNK_CHARS,
    DOCUMENT_MODES,
    MAX_CARRY_CHARS,
    SEGMENT_CHARS,
    TEXT_SUFFIXES,
    check_corpus,
    check_text_corpus,
    corpus_files,
    dialog_texts,
    document_stream,
    files_sha256,
    read_dialogs,
    read_dialogs_split,
    read_text,
    text_corpus_files,
    text_segments,
)
from clgpt.data.encode import (
    ENCODED_VERSION,
    PARALLEL_MIN_BYTES,
    default_workers,
    encode_dialog_files,
    encode_dialogs,
    encode_text_files,
    index_path,
    load_documents,
    load_encoded,
    sidecar_path,
)

__all__ = [
    "CHUNK_CHARS", "DOCUMENT_MODES", "ENCODED_VERSION", "MAX_CARRY_CHARS", "PAD_WIDTH", "PARALLEL_MIN_BYTES",
    "SEGMENT_CHARS", "TEXT_SUFFIXES", "DialogBatches", "PretrainBatches", "WindowSampler", "check_corpus",
    "check_text_corpus", "corpus_files", "default_workers", "dialog_batches", "dialog_rows", "dialog_texts",
    "document_stream", "encode_dialog_files", "encode_dialogs", "encode_text_files", "files_sha256", "index_path",
    "load_documents", "load_encoded", "pad_dialogs", "read_dialogs", "read_dialogs_split", "read_text",
    "sidecar_path", "text_batches", "text_corpus_files", "text_segments",
]
