//! wildfire recipes: the GPT model, its data pipeline and training loop (on burn-train),
//! checkpoints, generation, Hugging Face GPT-2 interoperability, and the `wildfire` command line.

pub mod alloc;
pub mod checkpoint;
pub mod cli;
pub mod config;
pub mod data;
pub mod generate;
pub mod hf;
pub mod logging;
pub mod model;
pub mod optim;
pub mod train;
