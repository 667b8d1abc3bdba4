//! The CUDA backend (written in a later change).
