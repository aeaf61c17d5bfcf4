"""data.py: DataConfig, presets, and load_examples over every source kind, on tiny local data.

The references are independent of data.py: the tokenizer is character-level (tiny_task's), so the
expected ids of a text are its characters looked up in the vocabulary, and the rendered chat
prompts are written out by hand.
"""

import dataclasses
import json
import logging
import socket
import string

import pytest

import config

import data
from data import DataConfig, apply_preset, load_examples

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
ROWS = [{"prompt": "1+2=", "answer": "3", "id": 0},
        {"prompt": "say hi", "answer": "hi", "id": 1},
        {"prompt": "4+4=", "answer": "8", "id": 2}]


@pytest.fixture(scope="module")
def tok():
    from tasks import tiny_task

    t = tiny_task.train_tokenizer([string.printable])  # every printable character is one token
    t.chat_template = TEMPLATE
    return t


@pytest.fixture(autouse=True)
def hermetic(tmp_path, monkeypatch):
    """datasets' cache under tmp_path, and no socket: nothing here may touch the network."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))

    def no_network(*a, **k):
        raise OSError("network disabled in tests")

    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)


def char_ids(tok, text: str) -> list[int]:
    vocab = tok.get_vocab()
    return [vocab[c] for c in text]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def sources(tmp_path, rows) -> dict:
    """The same rows as every kind of source load_examples reads: {kind: (path, split)}."""
    import datasets

    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "rows.parquet"))
    (tmp_path / "rows.json").write_text(json.dumps(rows))  # one JSON array
    ds.save_to_disk(str(tmp_path / "saved_ds"))
    other = datasets.Dataset.from_list([{**rows[0], "prompt": "9+9="}])
    datasets.DatasetDict(train=other, test=ds).save_to_disk(str(tmp_path / "saved_dict"))
    return {"parquet": (str(tmp_path / "rows.parquet"), "train"),
            "jsonl": (write_jsonl(tmp_path / "rows.jsonl", rows), "train"),
            "json": (str(tmp_path / "rows.json"), "train"),
            "dataset_dir": (str(tmp_path / "saved_ds"), "train"),
            "datasetdict_dir": (str(tmp_path / "saved_dict"), "test")}


def test_every_source_kind_gives_the_same_examples(tmp_path, tok):
    cfg = DataConfig(prompt_suffix=" ok")
    expected = [{**r, "prompt_ids": char_ids(tok, r["prompt"] + " ok"), "answer": r["answer"],
                 "prompt_messages": [{"role": "user", "content": r["prompt"] + " ok"}]}
                for r in ROWS]
    for kind, (path, split) in sources(tmp_path, ROWS).items():
        got = load_examples(dataclasses.replace(cfg, path=path, split=split), tok)
        assert got == expected, kind
    # the loop's eval call: path and split passed in
    path, _ = sources(tmp_path, ROWS)["datasetdict_dir"]
    cfg = dataclasses.replace(cfg, path=path, eval_path=path)
    assert load_examples(cfg, tok, split=cfg.eval_split, path=cfg.eval_path) == expected
    assert [e["prompt"] for e in load_examples(cfg, tok)] == ["9+9="]  # data.split="train"


def test_non_string_answers_become_strings(tmp_path, tok):
    path = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "1+1=", "answer": 2}])
    assert load_examples(DataConfig(path=path), tok)[0]["answer"] == "2"
    assert load_examples(DataConfig(path=path, answer_key=""), tok)[0]["answer"] is None


def test_chat_messages_with_system_prompt_and_suffix_in_last_user_turn(tmp_path, tok):
    messages = [{"role": "user", "content": "2+2="}, {"role": "assistant", "content": "4"},
                {"role": "user", "content": "3+3="}]
    import datasets

    path = str(tmp_path / "chat.parquet")  # a column holds either messages or text, not both
    datasets.Dataset.from_list([{"prompt": messages, "answer": "6"}]).to_parquet(path)
    cfg = DataConfig(path=path, chat_template=True, system_prompt="Be brief.", prompt_suffix=" Go.")
    got = load_examples(cfg, tok)
    assert got[0]["prompt_ids"] == char_ids(
        tok, "<|system|>Be brief.\n<|user|>2+2=\n<|assistant|>4\n<|user|>3+3= Go.\n<|assistant|>")
    text = write_jsonl(tmp_path / "text.jsonl", [{"prompt": "5+5=", "answer": "10"}])
    got_text = load_examples(dataclasses.replace(cfg, path=text), tok)
    assert got_text[0]["prompt_ids"] == char_ids(
        tok, "<|system|>Be brief.\n<|user|>5+5= Go.\n<|assistant|>")
    assert all(type(i) is int for i in got[0]["prompt_ids"])
    assert got[0]["prompt"][2]["content"] == "3+3="  # the row itself is not edited
    # the conversation the ids render, for environments and rewards
    assert got[0]["prompt_messages"] == [{"role": "system", "content": "Be brief."},
                                         *messages[:2], {"role": "user", "content": "3+3= Go."}]
    # a row's own system turn is kept, not doubled
    own = [{"role": "system", "content": "S"}, {"role": "user", "content": "x"}]
    ids = data.prompt_ids(cfg, tok, own, "row")
    assert ids == char_ids(tok, "<|system|>S\n<|user|>x Go.\n<|assistant|>")


def test_plain_text_with_system_prompt(tmp_path, tok):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "1+2=", "answer": "3"}])
    got = load_examples(DataConfig(path=path, system_prompt="Add.", prompt_suffix="?"), tok)
    assert got[0]["prompt_ids"] == char_ids(tok, "Add.\n\n1+2=?")
    assert got[0]["prompt_messages"] == [{"role": "system", "content": "Add."},
                                         {"role": "user", "content": "1+2=?"}]


def test_long_prompts_dropped_and_counted(tmp_path, tok, caplog):
    rows = [{"prompt": "x" * n, "answer": "a"} for n in (3, 10, 4, 11, 5)]
    path = write_jsonl(tmp_path / "long.jsonl", rows)
    with caplog.at_level(logging.INFO, logger="grpo"):
        got = load_examples(DataConfig(path=path, max_prompt_len=5), tok)
    assert [len(e["prompt_ids"]) for e in got] == [3, 4, 5]  # dataset order kept
    assert "2 dropped as longer than data.max_prompt_len=5" in caplog.text
    assert path in caplog.text
    with pytest.raises(ValueError, match=r"no example left.*data\.max_prompt_len=2") as e:
        load_examples(DataConfig(path=path, max_prompt_len=2), tok)
    assert "\n" not in str(e.value)


def test_gsm8k_preset(tmp_path, tok):
    assert data.gsm8k_answer("She pays 2 * 500 = 1000.\n#### 1,000") == "1000"
    assert data.gsm8k_answer("a #### 1 #### 2,345,678 ") == "2345678"
    assert data.gsm8k_answer("no marker") is None
    rows = [{"question": "Q1?", "answer": "work\n#### 1,000"},
            {"question": "Q2?", "answer": "no final answer"}]
    path = write_jsonl(tmp_path / "gsm.jsonl", rows)
    got = load_examples(DataConfig(preset="gsm8k", path=path), tok)
    suffix = ' Let\'s think step by step and output the final answer after "####".'
    assert got == [{"question": "Q1?", "answer": "1000",  # row 2 has no gold: dropped
                    "prompt_ids": char_ids(tok, "Q1?" + suffix),
                    "prompt_messages": [{"role": "user", "content": "Q1?" + suffix}]}]


def test_math_preset_boxed_extraction(tmp_path, tok):
    assert data.boxed_answer(r"so $\boxed{\frac{1}{2}}$.") == r"\frac{1}{2}"
    assert data.boxed_answer(r"\boxed{1} then \boxed{ {a}_{b} }") == "{a}_{b}"
    assert data.boxed_answer(r"\boxed{\frac{1}{2}") is None  # unbalanced
    assert data.boxed_answer("no box") is None
    path = write_jsonl(tmp_path / "m.jsonl", [{"problem": "P", "solution": r"x=\boxed{\sqrt{2}}"}])
    got = load_examples(DataConfig(preset="math", path=path), tok)
    assert got[0]["answer"] == r"\sqrt{2}"
    assert got[0]["prompt_ids"] == char_ids(
        tok, "P Please reason step by step, and put your final answer within \\boxed{}.")


def test_apply_preset_fills_only_defaults():
    full = apply_preset(DataConfig(preset="gsm8k"))  # a complete data section
    assert (full.path, full.config_name, full.eval_path, full.split, full.eval_split) == (
        "openai/gsm8k", "main", "openai/gsm8k", "train", "test")
    assert (full.prompt_key, full.answer_key) == ("question", "answer")
    assert full.prompt_suffix.endswith('final answer after "####".')
    mine = DataConfig(preset="gsm8k", prompt_suffix=" Mine.", max_prompt_len=64, chat_template=True)
    got = apply_preset(mine)
    assert (got.prompt_suffix, got.max_prompt_len, got.chat_template) == (" Mine.", 64, True)
    assert got.prompt_key == "question" and mine.prompt_key == "prompt"  # a copy
    # a user's own path: the preset's hub config and eval set are not mixed in
    own = apply_preset(DataConfig(preset="math", path="x.jsonl"))
    assert (own.path, own.config_name, own.eval_path, own.prompt_key) == ("x.jsonl", "", "", "problem")
    assert apply_preset(DataConfig()) == DataConfig()
    with pytest.raises(ValueError, match=r"data\.preset='gsm9k' is unknown.*\['geo3k', 'gsm8k', 'math'\]"):
        apply_preset(DataConfig(preset="gsm9k"))


@pytest.mark.parametrize("path", ["nope.jsonl", "data/nope.parquet", "/abs/dir/nope",
                                  "a/b/c", "./local/x", "plainname"])
def test_missing_local_path(path, tok):
    with pytest.raises(ValueError, match=r"data\.path=.*no such file or directory\. Fix"):
        load_examples(DataConfig(path=path), tok)


def test_unreachable_hub_id(tok, monkeypatch):
    import datasets
    import huggingface_hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    # both libraries read the variables at import: set what they read, so nothing waits on retries
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match=r"data\.eval_path=nobody-xyz/made-up-set is not a local "
                       r"path, and the Hugging Face hub is unreachable \(offline\?\) or has no "
                       r"dataset nobody-xyz/made-up-set .*Fix: download it") as e:
        load_examples(DataConfig(path="x.jsonl", eval_path="nobody-xyz/made-up-set"), tok,
                      path="nobody-xyz/made-up-set", split="test")
    assert "\n" not in str(e.value)


def test_missing_columns(tmp_path, tok):
    path = write_jsonl(tmp_path / "c.jsonl", [{"question": "1+1=", "gold": "2"}])
    with pytest.raises(ValueError, match=r"data\.prompt_key='prompt' is not a column .*"
                       r"\['question', 'gold'\].*Fix: set data\.prompt_key"):
        load_examples(DataConfig(path=path), tok)
    with pytest.raises(ValueError, match=r"data\.answer_key='answer' is not a column .*'gold'"):
        load_examples(DataConfig(path=path, prompt_key="question"), tok)
    got = load_examples(DataConfig(path=path, prompt_key="question", answer_key="gold"), tok)
    assert got[0]["answer"] == "2"


@pytest.mark.parametrize("prompt", [7, [{"role": "user"}], ["text"], []])
def test_bad_prompt_type_names_the_row(tmp_path, tok, prompt):
    path = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "ok", "answer": "1"},
                                              {"prompt": prompt, "answer": "1"}])
    with pytest.raises(ValueError, match=r"row 1: data\.prompt_key='prompt' holds a .*neither text"):
        load_examples(DataConfig(path=path, chat_template=True), tok)


def test_messages_need_chat_template(tmp_path, tok):
    path = write_jsonl(tmp_path / "m.jsonl", [{"prompt": [{"role": "user", "content": "hi"}],
                                              "answer": "1"}])
    with pytest.raises(ValueError, match=r"row 0: .*chat messages.*Fix: set data\.chat_template=true"):
        load_examples(DataConfig(path=path), tok)
    nouser = write_jsonl(tmp_path / "n.jsonl", [{"prompt": [{"role": "system", "content": "s"}],
                                                "answer": "1"}])
    with pytest.raises(ValueError, match=r"no user turn for data\.prompt_suffix"):
        load_examples(DataConfig(path=nouser, chat_template=True, prompt_suffix="!"), tok)


def test_empty_dataset(tmp_path, tok):
    import datasets

    # nothing left after the length filter: tested in test_long_prompts_dropped_and_counted;
    # an empty source (which datasets fails on, each kind differently) is found before datasets
    # reads it: one line naming the path
    datasets.Dataset.from_list(ROWS).select([]).save_to_disk(str(tmp_path / "e"))
    datasets.Dataset.from_list(ROWS).select([]).to_parquet(str(tmp_path / "e.parquet"))
    datasets.DatasetDict(train=datasets.Dataset.from_list(ROWS).select([]),
                         test=datasets.Dataset.from_list(ROWS)).save_to_disk(str(tmp_path / "d"))
    (tmp_path / "e.jsonl").write_text("\n")
    (tmp_path / "e.json").write_text("[]")
    (tmp_path / "empty.jsonl").write_text("")
    for name in ("e", "e.parquet", "d", "e.jsonl", "e.json", "empty.jsonl"):
        with pytest.raises(config.BadInput, match=r"data\.path=.*: no rows \(an empty file or "
                           r"dataset\)\. Fix") as e:
            load_examples(DataConfig(path=str(tmp_path / name)), tok)
        assert "\n" not in str(e.value)
    assert len(load_examples(DataConfig(path=str(tmp_path / "d"), split="test"), tok)) == len(ROWS)


def test_jsonl_line_that_is_not_json(tmp_path, tok):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n\n{"prompt": "b", "answer": \n')
    with pytest.raises(ValueError, match=r"data\.path=.*bad\.jsonl: line 3 is not JSON \(.*\)\. Fix"):
        load_examples(DataConfig(path=str(path)), tok)


def test_split_missing_from_saved_datasetdict(tmp_path, tok):
    path, _ = sources(tmp_path, ROWS)["datasetdict_dir"]
    cfg = DataConfig(path="x", eval_path=path)
    with pytest.raises(ValueError, match=r"data\.eval_split='validation': data\.eval_path=.* has "
                       r"splits \['test', 'train'\]\. Fix: set data\.eval_split"):
        load_examples(cfg, tok, split="validation", path=path)
    with pytest.raises(ValueError, match=r"data\.split='dev'"):
        load_examples(DataConfig(path=path, split="dev"), tok)


def test_other_local_path_errors(tmp_path, tok):
    (tmp_path / "plain").mkdir()
    with pytest.raises(ValueError, match=r"is a directory but not one written by datasets"):
        load_examples(DataConfig(path=str(tmp_path / "plain")), tok)
    (tmp_path / "rows.csv").write_text("prompt,answer\na,1\n")
    with pytest.raises(ValueError, match=r"unsupported file type '\.csv'"):
        load_examples(DataConfig(path=str(tmp_path / "rows.csv")), tok)
    with pytest.raises(ValueError, match=r"data\.path is empty"):
        load_examples(DataConfig(), tok)


def test_the_taught_base_writes_a_digit_and_stops_but_knows_no_sum(tmp_path):
    """tiny_task.teach_format against what its targets imply: after `c=` the digit c (a
    one-to-one map it can learn), after `a+b=` a digit drawn at random (no better guess than
    1/10 for the sum), <eos> after the digit; the random init does none of it (the control);
    and a task made with other settings is refused, not reused."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tasks import tiny_task

    def probe(root):
        tok = AutoTokenizer.from_pretrained(f"{root}/model")
        model = AutoModelForCausalLM.from_pretrained(f"{root}/model").eval()
        digits = [tok.convert_tokens_to_ids(str(d)) for d in range(10)]

        def next_probs(text):
            with torch.no_grad():
                ids = tok(text, add_special_tokens=False)["input_ids"]
                return model(torch.tensor([ids])).logits[0, -1].softmax(-1)
        copied = min(next_probs(f"{c}=")[digits[c]].item() for c in range(10))
        rows = tiny_task.make_prompts()
        right = sum(next_probs(r["prompt"])[digits[int(r["answer"])]].item()
                    for r in rows) / len(rows)
        stops = min(next_probs(r["prompt"] + r["answer"])[tok.eos_token_id].item() for r in rows)
        return copied, right, stops

    taught = tiny_task.ensure_tiny_task(str(tmp_path / "taught"), format_steps=150)
    copied, right, stops = probe(taught)
    assert copied > 0.9 and stops > 0.9, (copied, stops)
    assert 0.05 < right < 0.2, right  # 0.1 is the best a model without the sums can do
    copied, right, stops = probe(tiny_task.ensure_tiny_task(str(tmp_path / "random")))
    assert copied < 0.5 and stops < 0.5, (copied, stops)
    with pytest.raises(ValueError, match="made with .*'format_steps': 150.*, not .*"
                                         "'format_steps': 0"):
        tiny_task.ensure_tiny_task(taught)
