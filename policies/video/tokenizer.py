"""An offline T5 tokenizer for the tiny video generators: a Unigram vocabulary built in code, no files, no hub.

transformers v5's `T5Tokenizer` accepts `vocab=[(piece, log_prob), ...]` directly. The vocabulary holds whole
words for the tabletop-robot and video domain (as "▁word" pieces, SentencePiece's word-start mark) plus every
printable ASCII character, with and without the mark. Unigram's Viterbi search prefers a whole word (one piece,
score −3) over its spelling (one piece per character, −8 each), so known words are single tokens and an unseen
word ("grasp", "Dish") falls back to its characters instead of `<unk>`. Only non-ASCII characters map to `<unk>`.
"""

from __future__ import annotations

import string

WORD_SCORE = -3.0
CHAR_SCORE = -8.0

# Ordered and append-only: a token's id is its position, and saved text encoders depend on it.
DOMAIN_WORDS: tuple[str, ...] = tuple(
    """
    a an the and or of to in on onto into from with without at by for it its is are be that this then until so
    up down left right top bottom front back above below over under inside outside near far next beside between
    pick place put push pull slide shove nudge move lift drop set stack open close grab grasp hold release carry
    take turn rotate press reach touch give get sit sits build form tower drawer handle plate dish square area zone
    target region cube brick block object ball cup bowl box table robot arm gripper hand camera scene background
    red green blue yellow orange purple white black gray grey pink brown cyan magenta dark light bright
    small large big little first second third one two three slowly quickly fast slow smooth still moving static
    video frame frames shot view close-up wide motion high quality sharp blurry
    could you please
    """.split()
)


def tokenizer_vocab() -> list[tuple[str, float]]:
    """The (piece, score) list: T5's specials first (<pad> 0, </s> 1, <unk> 2), then words, then characters."""
    vocab: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    seen = {p for p, _ in vocab}
    for word in DOMAIN_WORDS:
        piece = "▁" + word
        if piece not in seen:
            vocab.append((piece, WORD_SCORE))
            seen.add(piece)
    chars = string.ascii_letters + string.digits + string.punctuation
    for c in chars:
        vocab.append((c, CHAR_SCORE))
    for c in chars:
        vocab.append(("▁" + c, CHAR_SCORE - 0.5))
    return vocab


def build_tokenizer():
    """A `T5Tokenizer` over `tokenizer_vocab()`, with no sentinel tokens (a T5 encoder alone never uses them)."""
    from transformers import T5Tokenizer

    return T5Tokenizer(vocab=tokenizer_vocab(), extra_ids=0)
