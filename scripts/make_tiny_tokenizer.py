"""Train the tiny BPE tokenizer shipped for tests and the built-in demo model.

It has the Gemma special-token layout (<pad>=0, <eos>=1, <bos>=2, <unk>=3), single digits as
tokens (so state bins tokenise predictably), and a vocabulary under the tiny preset's 1024.
Run: python scripts/make_tiny_tokenizer.py phyai_edge/assets/tiny_tokenizer.json
"""

import random
import sys

from tokenizers import Tokenizer, models, pre_tokenizers, trainers

WORDS = ["task", "state", "action", "pick", "up", "the", "red", "green", "blue", "cube", "place", "it", "in", "bowl", "box", "open", "close", "drawer", "door", "push", "pull", "move", "left", "right", "arm", "gripper", "stack", "towel", "fold", "put", "on", "table", "insert", "peg", "transfer", "object", "grasp", "release", "lift", "lower", "rotate", "turn", "wipe", "pour", "cup", "bottle"]


def corpus(n: int = 3000) -> list[str]:
    rng = random.Random(0)
    lines = []
    for _ in range(n):
        task = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8)))
        state = " ".join(str(rng.randint(0, 255)) for _ in range(rng.randint(1, 32)))
        lines.append(f"Task: {task}, State: {state};\nAction: ")
    return lines


def main(out: str) -> None:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.Metaspace()]
    )
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<pad>", "<eos>", "<bos>", "<unk>"])
    tok.train_from_iterator(corpus(), trainer)
    tok.save(out)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "phyai_edge/assets/tiny_tokenizer.json")
