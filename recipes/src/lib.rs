//! wildfire recipes: the `wildfire` command line. The training recipe (GPT model, data, loop)
//! arrives with its own issue; today the binary launches jobs and checks the collectives.

pub mod cli;
