"""kvfleet: the product's command line (`kvfleet engine|router|up`). The parts live in engine/, router/,
contract/ and deploy/; this package only dispatches to them."""
