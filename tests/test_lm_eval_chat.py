"""`--apply_chat_template` / `--fewshot_as_multiturn` through lm-eval's own request builder, on a narrow
checkpoint with the published LLaDA-8B-Instruct / Dream-Instruct tokenizer, chat template and stop tokens."""

import os
import shutil

import pytest
from lm_eval.tasks import TaskManager

import polestar
from polestar.evaluation.lm_eval_model import PolestarLM
from polestar.evaluation.tasks import write_task_dir
from polestar.fixtures import write_published_checkpoint
from tests.test_chat import EOT, NARROW, _force_token, expected_chat_ids


@pytest.fixture(scope="module")
def arith_task(tmp_path_factory):
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    directory = tmp_path_factory.mktemp("tasks")
    write_task_dir(directory, "arith", n=2, choices=2)
    manager = TaskManager(include_path=str(directory), include_defaults=False)  # no need to index lm-eval's own
    return manager.load(["polestar_arith"])["tasks"]["polestar_arith"]


@pytest.fixture(scope="module", params=["llada", "dream"])
def forced_lm(request, tmp_path_factory):
    """A narrow published-format checkpoint whose every prediction is the end-of-turn token."""
    family = request.param
    directory = write_published_checkpoint(tmp_path_factory.mktemp(family), family, 1, NARROW[family])
    _force_token(directory, family, EOT[family])
    yield family, PolestarLM(pretrained=str(directory), policy="fast-dllm", gen_length=16, block_length=8,
                             device="cpu", dtype="float32")
    shutil.rmtree(directory, ignore_errors=True)


def test_chat_prompts_are_rendered_once_and_stop_at_end_of_turn(forced_lm, arith_task, monkeypatch):
    family, lm = forced_lm
    arith_task.build_all_requests(apply_chat_template=True, fewshot_as_multiturn=True,
                                  chat_template=lm.apply_chat_template, tokenizer_name=lm.tokenizer_name)
    docs = sorted(arith_task.instances, key=lambda r: r.doc_id)
    assert len(docs) == 2
    user = [r.doc["prompt"] for r in docs]
    for req, text in zip(docs, user):
        assert req.args[0] == lm.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    seen = []
    real = polestar.generate

    def spy(model, prompts, **kwargs):
        seen.extend(prompts)
        return real(model, prompts, **kwargs)

    monkeypatch.setattr(polestar, "generate", spy)
    texts = lm.generate_until(docs)
    content = [t.strip() if family == "llada" else t for t in user]  # LLaDA's template trims the turn
    assert seen == [expected_chat_ids(family, text, None) for text in content]  # BOS / headers once, not twice
    assert texts == ["", ""]  # the first generated token is end-of-turn, a stop token of the chat format
    assert lm.chat_template(True) == lm.tokenizer.chat_template


def test_missing_chat_template_is_named():
    lm = PolestarLM(pretrained="tiny-llada", policy="parallel", gen_length=16, block_length=16, device="cpu")
    assert lm.tokenizer_name == "tiny-llada" and lm.chat_template(False) is None
    with pytest.raises(ValueError, match="no chat template; drop --apply_chat_template"):
        lm.apply_chat_template([{"role": "user", "content": "3+4"}])
