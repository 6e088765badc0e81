"""What the README promises a newcomer, where only its text can say it."""
from conftest import REPO


def quick_start() -> str:
    text = (REPO / "README.md").read_text()
    return text[text.index("## Quick start"):text.index("## Real data")]


def test_the_quick_start_says_how_to_install_on_a_cpu_machine_and_what_to_expect():
    """Installing the requirements on a machine without a GPU pulled the CUDA build of torch and its packages
    (gigabytes); the demo's time and score were stated as "~2 min" with no score, and a thread setting advised after
    the commands changed both without a word."""
    text = quick_start()
    assert "--index-url https://download.pytorch.org/whl/cpu" in text
    assert "val_bpb ~1.49" in text and "steps" in text and "OMP_NUM_THREADS" in text
    assert text.index("--index-url") < text.index("scripts/run_demo.sh")


def test_what_a_resume_does_without_a_checkpoint_and_after_the_run_finished_is_documented():
    text = (REPO / "README.md").read_text()
    assert "`train.resume=latest` with a run_id that has no checkpoint starts at step 0" in text
    assert "Once a run has shipped and scored its artifact, `train.resume=latest` under its run_id is\nrefused" in text
