"""Training from a Hugging Face model: tools/checkpoint_conversion.py imports a tiny Llama (at tp 2),
pretrain.py starts from it at pp 2 on real text (tools/stdlib_corpus.py, the model's own tokenizer)
at the loss ``transformers`` computes on the same first batch, trains, and the export of the trained
checkpoint loads in ``transformers`` with megatron_lite's logits."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
import transformers
from bridge_helpers import relative_error
from corpus_helpers import make_corpus
from dist_helpers import REPO, parse_losses, run_pretrain, run_script, run_world
from safetensors.torch import load_file

CONVERT = str(REPO / "tools" / "checkpoint_conversion.py")
SEQ, MBS, GBS, ITERS = 32, 2, 4, 4


def _tokenizer_dir(vocab, merges, out) -> int:
    """vocab.json / merges.txt as a tokenizer.json directory; returns the vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE.from_file(str(vocab), str(merges)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    out.mkdir()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return tok.get_vocab_size()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(model directory with its tokenizer, data prefix)."""
    root = tmp_path_factory.mktemp("hf_training")
    docs, vocab, merges = make_corpus(root, max_bytes=100_000, vocab_size=320)
    model_dir = root / "llama"
    size = _tokenizer_dir(vocab, merges, model_dir)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=size, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(model_dir)
    job = run_script(
        REPO / "tools" / "preprocess_data.py",
        [
            "--input", str(docs), "--json-keys", "text", "--output-prefix", str(root / "docs"), "--tokenizer-type",
            "HuggingFaceTokenizer", "--tokenizer-model", str(model_dir), "--append-eod", "--workers", "1",
        ],
        root,
    )  # fmt: skip
    assert job.returncode == 0, job.stderr
    return model_dir, str(root / "docs_text_document")


def _run(*args, cwd):
    return run_script(CONVERT, list(args), cwd, timeout=300)


def _train_args(model_dir, prefix) -> list[str]:
    return [
        "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(model_dir), "--data-path", prefix,
        "--split", "100,0,0", "--seq-length", str(SEQ), "--micro-batch-size", str(MBS),
        "--global-batch-size", str(GBS), "--train-iters", str(ITERS), "--lr", "3e-3", "--lr-warmup-iters", "0",
        "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000",
    ]  # fmt: skip


def _first_batch_loss(rank, world, model_dir, prefix) -> float:
    """transformers' mean token loss on the job's first global batch, read with the job's own dataset."""
    from megatron_lite.data.loaders import build_train_valid_datasets
    from megatron_lite.training.arguments import config_from_argv
    from megatron_lite.training.tokenizers import get_tokenizer

    config = config_from_argv([*_train_args(model_dir, prefix), "--vocab-size", "1", "--nproc-per-node", "1"])
    train, _ = build_train_valid_datasets(config, tokenizer=get_tokenizer(config))
    samples = [train[i] for i in range(GBS)]
    tokens = torch.stack([torch.as_tensor(s["tokens"]) for s in samples]).long()
    labels = torch.stack([torch.as_tensor(s["labels"]) for s in samples]).long()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        logits = model(input_ids=tokens).logits
    return F.cross_entropy(logits.flatten(0, 1).double(), labels.flatten()).item()


def _trained_logits(rank, world, ckpt, exported) -> float:
    """megatron_lite's logits of the trained pp 2 torch_dist checkpoint (read here at pp 1) against
    transformers' of the exported directory."""
    from megatron_lite.bridge import AutoBridge
    from megatron_lite.core import parallel_state
    from megatron_lite.training.checkpointing.torch_dist import load_distributed_weights

    parallel_state.initialize_model_parallel()
    provider = AutoBridge.from_hf_pretrained(exported).to_megatron_provider(load_weights=False)
    model = provider.provide().eval()
    load_distributed_weights([model], provider, ckpt, ITERS)
    ids = torch.randint(0, provider.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(1))
    reference = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    with torch.no_grad():
        ours = model(ids, torch.arange(SEQ).expand_as(ids)).transpose(0, 1)
        theirs = reference(input_ids=ids).logits
    return relative_error(ours, theirs)


@pytest.mark.world
def test_import_train_at_pp2_from_the_transformers_loss_and_export(llama, tmp_path):
    model_dir, prefix = llama
    imported = _run("import", "--hf-model", str(model_dir), "--megatron-path", "imported",
                    "--tensor-model-parallel-size", "2", "--quiet", cwd=tmp_path)  # fmt: skip
    assert imported.returncode == 0, imported.stdout[-2000:] + imported.stderr
    result = run_pretrain(
        [*_train_args(model_dir, prefix), "--pretrained-checkpoint", "imported", "--use-checkpoint-args",
         "--pipeline-model-parallel-size", "2", "--save", "trained", "--save-interval", str(ITERS),
         "--ckpt-format", "torch_dist"],
        tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr
    losses = parse_losses(result.stdout)
    [expected] = run_world(_first_batch_loss, 1, str(model_dir), prefix)
    assert abs(losses[1] - expected) <= 1e-4, (losses[1], expected)
    assert losses[ITERS] < losses[1] - 0.05, losses  # it trains

    exported = _run("export", "--hf-model", str(model_dir), "--megatron-path", "trained", "--hf-path", "out",
                    "--quiet", cwd=tmp_path)  # fmt: skip
    assert exported.returncode == 0, exported.stdout[-2000:] + exported.stderr
    assert (tmp_path / "out" / "tokenizer.json").exists()
    [error] = run_world(_trained_logits, 1, str(tmp_path / "trained"), str(tmp_path / "out"))
    assert error <= 1e-5
    # The imported (legacy format, tp 2) checkpoint exports back to the very tensors it was made of.
    back = _run("export", "--hf-model", str(model_dir), "--megatron-path", "imported", "--hf-path", "back",
                "--quiet", cwd=tmp_path)  # fmt: skip
    assert back.returncode == 0, back.stdout[-2000:] + back.stderr
    source, written = (
        load_file(f"{model_dir}/model.safetensors"),
        load_file(f"{tmp_path}/back/model.safetensors"),
    )
    assert written.keys() == source.keys() and all(torch.equal(written[n], source[n]) for n in source)


@pytest.mark.world
def test_conversion_errors_are_one_line_before_any_worker(llama, tmp_path, capsys, monkeypatch):
    """The tool's own entry point, in this process: each error is found before a worker starts."""
    from corpus_helpers import _tool

    convert = _tool("checkpoint_conversion")
    model_dir, _ = llama
    monkeypatch.chdir(tmp_path)
    held = tmp_path / "held"  # a checkpoint's tracker and metadata: enough to be refused over
    (held / "iter_0000000").mkdir(parents=True)
    (held / "latest_checkpointed_iteration.txt").write_text("0\n")
    (held / "iter_0000000" / "metadata.json").write_text('{"tensor_model_parallel_size": 1}')
    for args, named in (
        (["import", "--hf-model", str(held), "--megatron-path", "c"], "has no config.json"),
        (["import", "--hf-model", str(tmp_path / "nowhere"), "--megatron-path", "c"], "not a directory"),
        (["import", "--hf-model", str(model_dir), "--megatron-path", "c", "--tensor-model-parallel-size", "3"],
         "does not divide"),
        (["import", "--hf-model", str(model_dir), "--megatron-path", str(held)], "already holds a checkpoint"),
        (["export", "--hf-model", str(model_dir), "--megatron-path", "empty", "--hf-path", "o"], "holds no checkpoint"),
        (["export", "--hf-model", str(model_dir), "--megatron-path", str(held), "--hf-path", str(model_dir)],
         "would replace or lie inside --hf-model"),
    ):  # fmt: skip
        assert convert.main(args) == 2
        err = capsys.readouterr().err
        assert named in err and len(err.strip().splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["held"]
    assert sorted(p.name for p in held.iterdir()) == ["iter_0000000", "latest_checkpointed_iteration.txt"]
