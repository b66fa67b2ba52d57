"""Callables with known signatures for extension-loading tests."""

NOT_CALLABLE = 42


def two_kwargs(count: int = 10, name: str = "x") -> list[int]:
    return list(range(count))


def reward_fn(completions, items):
    return [0.0 for _ in completions]


class Outer:
    class Inner:
        @staticmethod
        def build() -> str:
            return "inner"


def raises() -> None:
    raise RuntimeError("factory exploded")


class CaptionPairs(list):
    """DPO items whose answers are {image, caption} mappings: not text the built-in packer reads."""

    def membership_ids(self):
        return tuple(f"caption-{i}" for i in range(len(self)))


def caption_pairs():
    return CaptionPairs(("Describe it", {"image": f"{i}.png", "caption": "a cat"},
                         {"image": f"{i}.png", "caption": "a dog"}) for i in range(3))


def exits(completions, items):
    """A reward that ends the process the way a script would."""
    import sys

    sys.exit(0)
