"""Comparing two models' vocabularies (OPD ``same_tokenizer`` mode scores ids directly)."""

from __future__ import annotations

from pathlib import Path

from runner.errors import Problem, RecipeError


def check_same_vocab(student_path: Path | str, teacher_path: Path | str, *,
                     trust_remote_code: bool = False) -> None:
    """RecipeError (key ``algo.mode``) unless both tokenizers map the same strings to the same
    ids. Both are loaded as the recipe loads them (``model.trust_remote_code``)."""
    from runner.models import load_tokenizer

    student = load_tokenizer(student_path, trust_remote_code=trust_remote_code).get_vocab()
    teacher = load_tokenizer(teacher_path, trust_remote_code=trust_remote_code).get_vocab()
    if student != teacher:
        raise RecipeError([Problem(
            "algo.mode", f"same_tokenizer needs one vocabulary, but the student's has "
            f"{len(student)} tokens ({student_path}) and the teacher's {len(teacher)} "
            f"({teacher_path})" + ("" if len(student) != len(teacher) else ", with different ids"),
            got="same_tokenizer", hint="use mode = 'cross_token_multimodal' for a teacher with "
            "its own tokenizer")])
