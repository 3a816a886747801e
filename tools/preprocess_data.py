"""Tokenize a JSONL corpus into Megatron's indexed dataset files (upstream's tools/preprocess_data.py).

    python tools/preprocess_data.py --input docs.jsonl --json-keys text --output-prefix data/docs \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \\
        --append-eod --workers 2

writes ``{prefix}_{key}_document.bin`` / ``.idx`` per JSON key, which megatron-core reads too. The
input is streamed in chunks with a bounded number in flight, so memory does not grow with the corpus.
Outputs are written under temporary names and renamed at the end: bad input (a line that is not
JSON, a missing key) stops the run with one line naming the line number, exit code 2, and leaves no
output file behind.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import itertools
import json
import multiprocessing
import os
import sys
import time

import numpy

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron_lite.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder  # noqa: E402
from megatron_lite.training.errors import ConfigError  # noqa: E402
from megatron_lite.training.tokenizers import TokenizerConfig, build_tokenizer  # noqa: E402

_CHUNK_LINES = 256  # lines per task: large enough to amortise pickling, small enough to stream


class InputError(Exception):
    """A bad input line: ``str()`` is ``LINE: problem``."""


_WORKER: Encoder | None = None  # this worker process's encoder, set by its pool initializer


def _init_worker(encoder: Encoder) -> None:
    global _WORKER
    _WORKER = encoder
    encoder.initializer()


def _encode_in_worker(chunk):
    return _WORKER.encode_chunk(chunk)


class Encoder:
    """Turns chunks of JSON lines into token ids; one per worker process."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.tokenizer = args, None

    def __getstate__(self):
        return {"args": self.args, "tokenizer": None}  # each worker builds its own

    def initializer(self) -> None:
        # One core per worker: parallelism comes from --workers, not from the tokenizer's threads.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        if self.tokenizer is None:
            self.tokenizer = build_tokenizer(_tokenizer_config(self.args))
        self.dtype = DType.optimal_dtype(self.tokenizer.vocab_size)

    def encode_chunk(self, chunk: tuple[int, list[str]]):
        """``(first_line, lines)`` -> ``(docs, bytes, tokens, {key: (ids, lengths)})`` or an InputError."""
        first, lines = chunk
        texts: dict[str, list[str]] = {key: [] for key in self.args.json_keys}
        for number, line in enumerate(lines, start=first):
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                return InputError(f"{number}: not valid JSON ({err.msg} at column {err.colno})")
            if not isinstance(record, dict):
                return InputError(f"{number}: expected a JSON object, got {type(record).__name__}")
            for key in self.args.json_keys:
                if key not in record:
                    return InputError(
                        f"{number}: missing key {key!r} (--json-keys {' '.join(self.args.json_keys)})"
                    )
                text = record[key]
                if isinstance(text, list):  # pre-split sentences, as upstream: one document
                    text = "".join(text)
                if not isinstance(text, str):
                    return InputError(f"{number}: {key!r} is {type(text).__name__}, not text")
                texts[key].append(text)
        out, tokens = {}, 0
        for key, batch in texts.items():
            encode = getattr(self.tokenizer, "tokenize_batch", None)
            docs = encode(batch) if encode else [self.tokenizer.tokenize(t) for t in batch]
            if self.args.append_eod:
                eod = self.tokenizer.eod
                docs = [d + [eod] if d else d for d in docs]
            lengths = [len(d) for d in docs]
            ids = numpy.array(list(itertools.chain.from_iterable(docs)), dtype=self.dtype)
            out[key] = (ids, lengths)
            tokens += ids.size
        return len(lines), sum(len(line.encode()) for line in lines), tokens, out


def _tokenizer_config(args: argparse.Namespace) -> TokenizerConfig:
    return TokenizerConfig(
        tokenizer_type=args.tokenizer_type,
        tokenizer_model=args.tokenizer_model,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        vocab_size=args.vocab_size,
    )


def _chunks(path: str):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        lines, first = [], 1
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue  # blank lines are not documents
            if not lines:
                first = number
            lines.append(line)
            if len(lines) == _CHUNK_LINES:
                yield first, lines
                lines = []
        if lines:
            yield first, lines


def _results(encoder: Encoder, path: str, workers: int):
    """Encoded chunks in input order, with at most ``2 x workers`` chunks in flight."""
    if workers == 1:
        encoder.initializer()
        yield from map(encoder.encode_chunk, _chunks(path))
        return
    # fork where there is one: workers start in milliseconds instead of re-importing torch.
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    with multiprocessing.get_context(method).Pool(workers, _init_worker, (encoder,)) as pool:
        pending = collections.deque()
        for chunk in _chunks(path):
            pending.append(pool.apply_async(_encode_in_worker, (chunk,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


class Progress:
    """Upstream's progress line on stderr, with tokens per second added."""

    def __init__(self, log_interval: int) -> None:
        self.log_interval, self.start = log_interval, time.time()
        self.docs = self.bytes = self.tokens = 0
        self.next_log = log_interval

    def update(self, docs: int, nbytes: int, tokens: int, final: bool = False) -> None:
        self.docs, self.bytes, self.tokens = self.docs + docs, self.bytes + nbytes, self.tokens + tokens
        if self.docs >= self.next_log or final:
            self.next_log = (self.docs // self.log_interval + 1) * self.log_interval
            elapsed = max(time.time() - self.start, 1e-9)
            print(
                f"Processed {self.docs} documents ({self.docs / elapsed:.1f} docs/s, "
                f"{self.tokens / elapsed:.0f} tokens/s, {self.bytes / elapsed / 1024 / 1024:.2f} MB/s).",
                file=sys.stderr,
                flush=True,
            )


def preprocess(args: argparse.Namespace) -> Progress:
    """Write every key's indexed dataset; raises InputError (outputs removed) on bad input."""
    tokenizer = build_tokenizer(_tokenizer_config(args))
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    final = {key: f"{args.output_prefix}_{key}_document" for key in args.json_keys}
    temp = {key: f"{prefix}.tmp{os.getpid()}" for key, prefix in final.items()}
    os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
    builders = {key: IndexedDatasetBuilder(temp[key] + ".bin", dtype=dtype) for key in args.json_keys}
    progress = Progress(args.log_interval)
    try:
        encoder = Encoder(args)
        encoder.tokenizer = tokenizer  # in-process with one worker; workers build their own
        for result in _results(encoder, args.input, args.workers):
            if isinstance(result, InputError):
                raise result
            docs, nbytes, tokens, encoded = result
            for key, (ids, lengths) in encoded.items():
                # As upstream: an empty document stays, as a document with no sequences.
                builders[key].add_documents(ids, lengths)
            progress.update(docs, nbytes, tokens)
        progress.update(0, 0, 0, final=True)
        for key, builder in builders.items():
            builder.finalize(temp[key] + ".idx")
        for key in args.json_keys:
            for ext in (".bin", ".idx"):
                os.replace(temp[key] + ext, final[key] + ext)
    finally:
        for key, builder in builders.items():
            builder.data_file.close()
            for ext in (".bin", ".idx"):
                if os.path.exists(temp[key] + ext):
                    os.remove(temp[key] + ext)
    return progress


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="preprocess_data.py", description=__doc__.splitlines()[0])
    group = parser.add_argument_group("tokenizer")
    group.add_argument(
        "--tokenizer-type", required=True, help="NullTokenizer, GPT2BPETokenizer or HuggingFaceTokenizer."
    )
    group.add_argument("--vocab-file", default=None, help="GPT-2 vocab.json.")
    group.add_argument("--merge-file", default=None, help="GPT-2 merges.txt.")
    group.add_argument("--tokenizer-model", default=None, help="Local tokenizer directory or tokenizer.json.")
    group.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer's vocabulary size.")
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True, help="JSONL file (.gz too), one document per line.")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="Keys to extract from each line.")
    group.add_argument("--append-eod", action="store_true", help="Append an <eod> token to each document.")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True, help="Path of the output files without suffix.")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, required=True, help="Worker processes.")
    group.add_argument("--log-interval", type=int, default=1000, help="Documents between progress lines.")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    if args.log_interval < 1:
        parser.error("--log-interval must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = get_args(argv)

    def fail(message: str) -> int:
        print(f"preprocess_data.py: error: {message}", file=sys.stderr)
        return 2

    if not os.path.isfile(args.input):
        return fail(f"--input: {args.input} does not exist")
    try:
        progress = preprocess(args)  # builds the tokenizer first: bad files fail before any worker
    except ConfigError as err:
        return fail(str(err))
    except InputError as err:
        return fail(f"{args.input}:{err}; no output written")
    except UnicodeDecodeError as err:
        return fail(f"{args.input}: not UTF-8 text ({err.reason} at byte {err.start}); no output written")
    for key in args.json_keys:
        print(
            f"wrote {args.output_prefix}_{key}_document.bin/.idx ({progress.docs} documents, {progress.tokens} tokens)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
