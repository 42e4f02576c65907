fn main() {
    std::process::exit(kvbridge::cli::main());
}
