//! `cargo bench --bench nvme [-- OPTIONS]`: the same measurement as `strata bench nvme`,
//! with the same options (see `strata bench nvme --help`).

use clap::Parser;

#[derive(Parser)]
#[command(name = "nvme", about = "strata's NVMe tier against fio")]
struct Cli {
    #[command(flatten)]
    args: strata::bench::nvme::NvmeArgs,
}

fn main() {
    strata::logging::init();
    // cargo passes --bench to benchmark binaries; it is not one of ours.
    let cli = Cli::parse_from(std::env::args().filter(|a| a != "--bench"));
    if let Err(error) = strata::bench::nvme::run(&cli.args) {
        eprintln!("strata: error: {error}");
        std::process::exit(1);
    }
}
