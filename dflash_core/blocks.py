"""The block a drafter drafts and a decode step verifies, resolved once per evaluation (flows/checks.py) from the
block size a request chose and the drafter's config. The stages take the resolved value as it is: what the drafts
key holds, the slots the replay drafts and the most a step can accept all come from this one value."""

from dataclasses import dataclass

from .drafter_config import DrafterConfig, chosen_block_size


@dataclass(frozen=True)
class Block:
    """One drafter's block as an evaluation verifies it."""

    own: int  # the drafter's own block size (its config's)
    size: int  # the slots it drafts per block: the block size chosen, else its own
    verified_tokens: int  # what a step verifies at most: size, or one more when the anchor's slot drafts too

    @property
    def chosen(self) -> int | None:
        """The block size chosen, None when it is the drafter's own, so that both name one setting everywhere
        (keys, series, tags, run names: drafter_config.chosen_block_size)."""
        return None if self.size == self.own else self.size


def resolve_block(requested: int | None, config: DrafterConfig) -> Block:
    """The block `config`'s drafter drafts when a request asks for block size `requested` (None: its own).
    Raises ValueError for a block size it cannot draft (drafter_config.check_block_size)."""
    size = chosen_block_size(requested, config.block_size) or config.block_size
    return Block(config.block_size, size, config.verified_tokens(size))
