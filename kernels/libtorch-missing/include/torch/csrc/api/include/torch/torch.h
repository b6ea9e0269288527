// Stand-in for libtorch in a checkout where `scripts/setup` has not run yet: `.libtorch` (what
// .cargo/config.toml points LIBTORCH at) is committed as a link to this directory, and the
// set-up step replaces it with a link to the installed torch package. Any build before that
// stops here with the fix.
#error "ckptune: libtorch is not installed in this checkout; run scripts/setup (it installs torch==2.13.0 from PyPI into ~/.cache/ckptune and links it as .libtorch)"
