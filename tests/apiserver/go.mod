module staleguard/apiserver

// Built in GOPATH mode from Debian packages (see build.sh); this file marks
// the code as module code so /vN import paths resolve against them.
go 1.24
