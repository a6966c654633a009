import pytest

from backends.arithmetic_task import ArithmeticTask


def test_heldout_never_in_training_stream_and_stream_is_seeded():
    task = ArithmeticTask(max_operand=9, max_second_operand=9, num_heldout=20)
    held = {p.prompt for p in task.heldout()}
    assert len(held) == 20
    drawn = task.train_stream(seed=1).take(2000)
    assert not held & {p.prompt for p in drawn}
    assert all(p.answer == sum(map(int, p.prompt[:-1].split("+"))) for p in drawn)
    assert drawn[:50] == task.train_stream(seed=1).take(50)
    assert drawn[:50] != task.train_stream(seed=2).take(50)


def test_stream_resumes_from_its_position():
    task = ArithmeticTask()
    s = task.train_stream(seed=3)
    s.take(37)
    resumed = task.train_stream(seed=3, drawn=s.drawn)
    assert resumed.take(10) == s.take(10)


def test_bad_heldout_size():
    with pytest.raises(ValueError, match="num_heldout"):
        ArithmeticTask(max_operand=2, max_second_operand=2, num_heldout=9)
