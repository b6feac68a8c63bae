from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from postrl.data import DatasetError, PromptSampler, load_prompt_dataset


def test_jsonl_rows_keep_every_other_column(char_tokenizer, arithmetic_jsonl):
    ds = load_prompt_dataset([str(arithmetic_jsonl)], char_tokenizer)
    assert len(ds) == 16
    first = ds[0]
    assert first.text == "10+20=" and first.columns == {"answer": "30", "task_type": "add"}
    assert first.prompt_ids[0] == char_tokenizer.bos_token_id
    assert first.source.endswith("train.jsonl:1")


def test_parquet_and_chat_messages(tmp_path, char_tokenizer):
    path = tmp_path / "chat.parquet"
    table = pa.table(
        {
            "messages": [[{"role": "user", "content": "1+1="}]],
            "answer": ["2"],
            "tests": [["assert f() == 2"]],
        }
    )
    pq.write_table(table, path)
    ds = load_prompt_dataset([str(path)], char_tokenizer)
    assert ds[0].text == "<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n"
    assert ds[0].columns == {"answer": "2", "tests": ["assert f() == 2"]}
    assert char_tokenizer.decode(ds[0].prompt_ids) == ds[0].text


def test_string_prompt_through_chat_template(tmp_path, char_tokenizer):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "hi"}) + "\n")
    ds = load_prompt_dataset([str(path)], char_tokenizer, apply_chat_template=True)
    assert ds[0].text.startswith("<|im_start|>user\nhi")


@pytest.mark.parametrize(
    "line, reason",
    [
        ("{not json", "invalid JSON"),
        ('{"question": "x"}', "neither 'prompt' nor 'messages'"),
        ('{"prompt": 5}', "'prompt' must be a non-empty string"),
        ('{"messages": [{"role": "user"}]}', "'messages'[0] must be an object"),
        ('["a"]', "row must be an object"),
    ],
)
def test_malformed_row_names_file_and_line(tmp_path, char_tokenizer, line, reason):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n' + line + "\n")
    with pytest.raises(DatasetError) as err:
        load_prompt_dataset([str(path)], char_tokenizer)
    assert f"{path}:2:" in str(err.value) and reason in str(err.value)


def test_too_long_prompt_error_or_skip(tmp_path, char_tokenizer):
    path = tmp_path / "long.jsonl"
    path.write_text('{"prompt": "short"}\n{"prompt": "' + "x" * 50 + '"}\n')
    with pytest.raises(DatasetError, match=r"long.jsonl:2: prompt has 51 tokens, more than data.max_prompt_tokens=20"):
        load_prompt_dataset([str(path)], char_tokenizer, max_prompt_tokens=20)
    ds = load_prompt_dataset([str(path)], char_tokenizer, max_prompt_tokens=20, on_bad_row="skip")
    assert len(ds) == 1 and len(ds.skipped) == 1 and "long.jsonl:2" in ds.skipped[0]


def test_skipped_rows_are_listed_in_file_order_whatever_refused_them(tmp_path, char_tokenizer):
    path = tmp_path / "mixed.jsonl"
    rows = ['{"prompt": "ok"}', "{broken", '{"prompt": "' + "x" * 50 + '"}', "", '{"other": 1}', '{"prompt": "fine"}']
    path.write_text("\n".join(rows) + "\n")
    ds = load_prompt_dataset([str(path)], char_tokenizer, max_prompt_tokens=20, on_bad_row="skip")
    assert [p.source for p in ds.prompts] == [f"{path}:1", f"{path}:6"]
    assert [entry.split(": ")[0] for entry in ds.skipped] == [f"{path}:2", f"{path}:3", f"{path}:5"]
    assert "prompt has 51 tokens" in ds.skipped[1] and "neither 'prompt' nor 'messages'" in ds.skipped[2]


def test_missing_file_and_bad_extension(tmp_path, char_tokenizer):
    with pytest.raises(DatasetError, match="does not exist"):
        load_prompt_dataset([str(tmp_path / "nope.jsonl")], char_tokenizer)
    csv = tmp_path / "x.csv"
    csv.write_text("prompt\n")
    with pytest.raises(DatasetError, match="unsupported extension '.csv'"):
        load_prompt_dataset([str(csv)], char_tokenizer)


def test_sampler_is_seeded_epoch_aware_and_resumable():
    a = PromptSampler(5, seed=3)
    first = a.next_indices(7)  # crosses into epoch 1
    assert sorted(first[:5]) == list(range(5)) and a.epoch == 1
    state = a.state_dict()
    rest = a.next_indices(6)
    b = PromptSampler(5, seed=3)
    b.load_state_dict(state)
    assert b.next_indices(6) == rest
    assert PromptSampler(5, seed=3).next_indices(7) == first
    assert PromptSampler(20, seed=4).next_indices(20) != PromptSampler(20, seed=3).next_indices(20)
    with pytest.raises(ValueError, match="dataset of 5 prompts, this one has 6"):
        PromptSampler(6, seed=3).load_state_dict(state)
