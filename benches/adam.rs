//! `cargo bench --bench adam [-- OPTIONS]`: the same measurement as `strata bench adam`,
//! with the same options (see `strata bench adam --help`).

use clap::Parser;

#[derive(Parser)]
#[command(name = "adam", about = "strata's CPU AdamW against a STREAM triad")]
struct Cli {
    #[command(flatten)]
    args: strata::bench::adam::AdamArgs,
}

fn main() {
    strata::logging::init();
    // cargo passes --bench to benchmark binaries; it is not one of ours.
    let cli = Cli::parse_from(std::env::args().filter(|a| a != "--bench"));
    if let Err(error) = strata::bench::adam::main(&cli.args) {
        eprintln!("strata: error: {error}");
        std::process::exit(1);
    }
}
