"""The generate tests' config and stand-in engine (unit: tests/unit/pipeline/test_generate.py; integration:
tests/integration/test_generate_stage.py)."""
from pipeline.target_model.engines import Generation
from pipeline.run import DEFAULT_CONFIG, load_config


def _cfg(target, run_dir, files, *extra):
    return load_config(DEFAULT_CONFIG, [f"target.path={target}", f"run_dir={run_dir}",
                                        f"data.train_files=[{','.join(map(str, files))}]",
                                        "generate.max_new_tokens=8", "generate.batch_size=4", *extra])


class FakeEngine:
    """Answers with a counter, records every prompt; raises or answers empty on chosen prompt text."""

    def __init__(self, tokenizer, boom=(), empty=()):
        self.tokenizer, self.boom, self.empty = tokenizer, boom, empty
        self.prompts, self.calls = [], 0

    def generate(self, prompts, sampling, seeds):
        out = []
        for p in prompts:
            text = self.tokenizer.decode(p)
            if any(b in text for b in self.boom):
                raise RuntimeError("engine exploded")
            self.prompts.append(text)
            self.calls += 1
            answer = "" if any(e in text for e in self.empty) else f"NEW{self.calls}"
            out.append(Generation(answer, "stop" if self.calls % 2 else "length", 3))
        return out
