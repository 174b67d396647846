"""The validate: section: prompts from a list or a file of one prompt per line, and its checks."""

import pytest

from slidefusion.core.errors import UserError
from slidefusion.training.validation_config import ValidateConfig


def test_prompts_come_from_a_list_or_a_file(tmp_path):
    assert ValidateConfig(prompts=[" a fox ", "a car"]).prompt_list() == ["a fox", "a car"]
    path = tmp_path / "prompts.txt"
    path.write_text("a red fox\n\n  a city at night  \n")
    assert ValidateConfig(prompts=str(path)).prompt_list() == ["a red fox", "a city at night"]
    assert ValidateConfig().prompt_list() == [] and not ValidateConfig().enabled
    path.write_text("\n \n")
    with pytest.raises(UserError, match="holds no prompt"):
        ValidateConfig(prompts=str(path)).prompt_list()
    path.write_bytes(b"caf\xe9\n")
    with pytest.raises(UserError, match="cannot be read as UTF-8"):
        ValidateConfig(prompts=str(path)).prompt_list()


@pytest.mark.parametrize("kwargs, needle", [({"prompts": "/nowhere/prompts.txt"}, "no such file"),
                                            ({"every": 0}, "validate.every=0"), ({"prompts": []}, "non-empty list"),
                                            ({"steps": 0}, "validate.steps=0"), ({"guidance": -1.0}, "validate.guidance")])
def test_bad_values_are_one_line(kwargs, needle):
    with pytest.raises(UserError, match=needle):
        ValidateConfig(**kwargs)
