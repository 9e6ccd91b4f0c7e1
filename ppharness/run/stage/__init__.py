"""A stage of the chain: ``stage.Stage`` over its record (``requests``), receipt (``inbound``, ``admission``,
``replay``), scheduler (``schedule``) and send path (``outbound``), and its part in speculative decoding
(``speculation``, ``windows``). ``ppharness.run.stage.stage`` walks a token through them."""
