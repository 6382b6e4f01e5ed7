"""User-facing errors: the CLI prints their message (which names the fix) without a traceback."""


class PipelineError(Exception):
    """Base class of every error the CLI reports as a one-paragraph message, exit code 2."""


class ConfigError(PipelineError):
    """An unknown config key or a bad value; the message starts with the dotted key."""

    def __str__(self) -> str:
        return f"config error: {self.args[0]}"


class TargetNotFoundError(PipelineError):
    """The target weights are not on this machine (nothing is downloaded at run time)."""


class BadInputFileError(PipelineError):
    """A whole input file is unreadable (missing, not JSONL/Parquet): the run stops."""


class ShardPlanMismatchError(PipelineError):
    """A resumed run would map other rows onto already committed shards (inputs or sharding changed)."""


class MissingStageOutputError(PipelineError, FileNotFoundError):
    """A stage needs what an earlier stage writes (e.g. a committed drafter checkpoint) and it is absent."""


class StaleStageOutputError(PipelineError):
    """What an earlier stage wrote belongs to an older state of the run (e.g. calibrate's refitted
    confidence head of a drafter retrained since): rerun that stage."""
