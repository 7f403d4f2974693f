//! What the engine and the drafter both say of sequences: llama.cpp's id for one, and how
//! much two token lists share.

use llama_cpp_2::token::LlamaToken;

/// A sequence's id as llama.cpp takes it.
pub(crate) fn seq_id(seq: usize) -> i32 {
    i32::try_from(seq).unwrap_or(i32::MAX)
}

/// How many tokens `a` and `b` begin with alike.
pub(crate) fn common_prefix(a: &[LlamaToken], b: &[LlamaToken]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}
