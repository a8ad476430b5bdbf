// RUN: moec-opt %s --split-input-file --verify-diagnostics

// Errors every compute op checks: split value, split spec, task_num,
// tiling slot, result slot, and the fill config of each op kind.

moe.graph "g" {
  %y = moe.input "y" : !moe.tensor<[16, 8], f32>
  // expected-error@+1 {{'moe.swiglu' op 's': split_value must be positive, got 0}}
  %a = moe.swiglu "s"(%y) -> "a" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 0 : i64} : (!moe.tensor<[16, 8], f32>) -> !moe.tensor<[16, 4], f32>
}

// -----

moe.graph "g" {
  %y = moe.input "y" : !moe.tensor<[16, 8], f32>
  // expected-error@+1 {{'moe.swiglu' op 's': split_value must be positive, got -4}}
  %a = moe.swiglu "s"(%y) -> "a" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = -4 : i64} : (!moe.tensor<[16, 8], f32>) -> !moe.tensor<[16, 4], f32>
}

// -----

moe.graph "g" {
  %y = moe.input "y" : !moe.tensor<[16, 8], f32>
  // expected-error@+1 {{'moe.swiglu' op 's': split input 0 names operand 1, but the op has 1 operand}}
  %a = moe.swiglu "s"(%y) -> "a" {split = #moe.split<inputs = [1:0], output_dims = [0]>, split_value = 4 : i64} : (!moe.tensor<[16, 8], f32>) -> !moe.tensor<[16, 4], f32>
}

// -----

moe.graph "g" {
  %da = moe.input "da" : !moe.tensor<[16, 4], f32>
  %y = moe.input "y" : !moe.tensor<[16, 8], f32>
  // expected-error@+1 {{'moe.swiglu_grad' op 'sg': split input 1 names operand -1, but the op has 2 operands}}
  %a = moe.swiglu_grad "sg"(%da, %y) -> "a" {split = #moe.split<inputs = [0:0, -1:0], output_dims = [0]>, split_value = 4 : i64} : (!moe.tensor<[16, 4], f32>, !moe.tensor<[16, 8], f32>) -> !moe.tensor<[16, 8], f32>
}

// -----

moe.graph "g" {
  %y = moe.input "y" : !moe.tensor<[16, 8], f32>
  // expected-error@+1 {{'moe.swiglu' op 's': split input 0 splits dim 2 of operand 0 'y', which has rank 2}}
  %a = moe.swiglu "s"(%y) -> "a" {split = #moe.split<inputs = [0:2], output_dims = [0]>, split_value = 4 : i64} : (!moe.tensor<[16, 8], f32>) -> !moe.tensor<[16, 4], f32>
}

// -----

moe.graph "g" {
  %y = moe.input "y" : !moe.tensor<[16, 8], f32>
  %w = moe.input "w" : !moe.tensor<[2, 8, 4], f32>
  %gl = moe.input "gl" : !moe.tensor<[2], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': split input 0 splits dim -1 of operand 1 'w', which has rank 3}}
  %a = moe.gmm "m"(%y, %w, %gl) -> "a" {split = #moe.split<inputs = [1:-1], output_dims = [0]>, split_value = 4 : i64} : (!moe.tensor<[16, 8], f32>, !moe.tensor<[2, 8, 4], f32>, !moe.tensor<[2], i64>) -> !moe.tensor<[16, 4], f32>
}

// -----

moe.graph "g" {
  %y = moe.input "y" : !moe.tensor<[16, 8], f32>
  // expected-error@+1 {{'moe.swiglu' op 's': split spec needs at least one output dim}}
  %a = moe.swiglu "s"(%y) -> "a" {split = #moe.split<inputs = [0:0], output_dims = []>, split_value = 4 : i64} : (!moe.tensor<[16, 8], f32>) -> !moe.tensor<[16, 4], f32>
}

// -----

moe.graph "g" {
  %y = moe.input "y" : !moe.tensor<[16, 8], f32>
  // expected-error@+1 {{'moe.swiglu' op 's': split output dim 2 is out of range for result 'a' of rank 2}}
  %a = moe.swiglu "s"(%y) -> "a" {split = #moe.split<inputs = [0:0], output_dims = [0, 2]>, split_value = 4 : i64} : (!moe.tensor<[16, 8], f32>) -> !moe.tensor<[16, 4], f32>
}

// -----

moe.graph "g" {
  %off = moe.input "off" : !moe.tensor<[4], i64>
  %x = moe.input "x" : !moe.tensor<[32, 8], f32>
  %soff = moe.input "soff" : !moe.tensor<[4], i64>
  %n = moe.input "n" : !moe.tensor<[4], i32>
  // expected-error@+1 {{'moe.dispatch' op 'dispatch': split output dim -1 is out of range for result 'a' of rank 2}}
  %a = moe.dispatch "dispatch"(%off, %x, %soff, %n) -> "a" {split = #moe.split<inputs = [], output_dims = [-1]>, split_value = 4 : i64} : (!moe.tensor<[4], i64>, !moe.tensor<[32, 8], f32>, !moe.tensor<[4], i64>, !moe.tensor<[4], i32>) -> !moe.tensor<[32, 8], f32>
}

// -----

moe.graph "g" {
  %y = moe.input "y" : !moe.tensor<[16, 8], f32>
  // expected-error@+1 {{'moe.swiglu' op 's': task_num 'num_experts *': column 14: expected an operand after '*'}}
  %a = moe.swiglu "s"(%y) -> "a" {split = #moe.split<inputs = [0:0], output_dims = [0], task_num = "num_experts *">, split_value = 4 : i64} : (!moe.tensor<[16, 8], f32>) -> !moe.tensor<[16, 4], f32>
}

// -----

moe.graph "g" {
  %y = moe.input "y" : !moe.tensor<[16, 8], f32>
  // expected-error@+1 {{'moe.swiglu' op 's': task_num '(per_expert_seq / split_value': column 30: expected ')' to close '(' at column 1}}
  %a = moe.swiglu "s"(%y) -> "a" {split = #moe.split<inputs = [0:0], output_dims = [0], task_num = "(per_expert_seq / split_value">, split_value = 4 : i64} : (!moe.tensor<[16, 8], f32>) -> !moe.tensor<[16, 4], f32>
}

// -----

moe.graph "g" {
  %y = moe.input "y" : !moe.tensor<[16, 8], f32>
  // expected-error@+1 {{'moe.swiglu' op 's': tiling slot must be -1 (none) or a slot index 0 to 65535, got -2}}
  %a = moe.swiglu "s"(%y) -> "a" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4 : i64, tiling_slot = -2 : i64} : (!moe.tensor<[16, 8], f32>) -> !moe.tensor<[16, 4], f32>
}

// -----

moe.graph "g" {
  %y = moe.input "y" : !moe.tensor<[16, 8], f32>
  %w = moe.input "w" : !moe.tensor<[2, 8, 4], f32>
  %gl = moe.input "gl" : !moe.tensor<[2], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': result tensor 'a' has slot -3: a slot is 0 to 65535}}
  %a = moe.gmm "m"(%y, %w, %gl) -> "a" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4 : i64, slot = -3 : i64} : (!moe.tensor<[16, 8], f32>, !moe.tensor<[2, 8, 4], f32>, !moe.tensor<[2], i64>) -> !moe.tensor<[16, 4], f32>
}

// -----

// swiglu and swiglu_grad take no fill config.
moe.graph "g" {
  %y = moe.input "y" : !moe.tensor<[16, 8], f32>
  // expected-error@+1 {{'moe.swiglu' op 's': unknown fill key 'advance' for a moe.swiglu op (it takes no fill config)}}
  %a = moe.swiglu "s"(%y) -> "a" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4 : i64, fill = {advance = "vector"}} : (!moe.tensor<[16, 8], f32>) -> !moe.tensor<[16, 4], f32>
}

// -----

moe.graph "g" {
  %da = moe.input "da" : !moe.tensor<[16, 4], f32>
  %y = moe.input "y" : !moe.tensor<[16, 8], f32>
  // expected-error@+1 {{'moe.swiglu_grad' op 'sg': unknown fill key 'event_group' for a moe.swiglu_grad op (it takes no fill config)}}
  %a = moe.swiglu_grad "sg"(%da, %y) -> "a" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4 : i64, fill = {event_group = 1 : i64}} : (!moe.tensor<[16, 4], f32>, !moe.tensor<[16, 8], f32>) -> !moe.tensor<[16, 8], f32>
}

// -----

moe.graph "g" {
  %off = moe.input "off" : !moe.tensor<[4], i64>
  %x = moe.input "x" : !moe.tensor<[32, 8], f32>
  %soff = moe.input "soff" : !moe.tensor<[4], i64>
  %n = moe.input "n" : !moe.tensor<[4], i32>
  // expected-error@+1 {{'moe.dispatch' op 'dispatch': unknown fill key 'num_cube_cores' for a moe.dispatch op (expected one of: advance event_group)}}
  %a = moe.dispatch "dispatch"(%off, %x, %soff, %n) -> "a" {split = #moe.split<inputs = [], output_dims = [0]>, split_value = 4 : i64, fill = {num_cube_cores = 2 : i64}} : (!moe.tensor<[4], i64>, !moe.tensor<[32, 8], f32>, !moe.tensor<[4], i64>, !moe.tensor<[4], i32>) -> !moe.tensor<[32, 8], f32>
}

// -----

moe.graph "g" {
  %off = moe.input "off" : !moe.tensor<[4], i64>
  %x = moe.input "x" : !moe.tensor<[32, 8], f32>
  %soff = moe.input "soff" : !moe.tensor<[4], i64>
  %n = moe.input "n" : !moe.tensor<[4], i32>
  // expected-error@+1 {{'moe.combine' op 'combine': unknown fill key 'event_delta' for a moe.combine op (expected one of: advance event_group)}}
  %a = moe.combine "combine"(%off, %x, %soff, %n) -> "a" {split = #moe.split<inputs = [1:0], output_dims = [0]>, split_value = 4 : i64, fill = {event_delta = 2 : i64}} : (!moe.tensor<[4], i64>, !moe.tensor<[32, 8], f32>, !moe.tensor<[4], i64>, !moe.tensor<[4], i32>) -> !moe.tensor<[32, 8], f32>
}

// -----

moe.graph "g" {
  %y = moe.input "y" : !moe.tensor<[16, 8], f32>
  %w = moe.input "w" : !moe.tensor<[2, 8, 4], f32>
  %gl = moe.input "gl" : !moe.tensor<[2], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': unknown fill key 'event_group' for a moe.gmm op (expected one of: offset_inputs rank_in_event global_trigger out_offset advance event_delta num_cube_cores)}}
  %a = moe.gmm "m"(%y, %w, %gl) -> "a" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4 : i64, fill = {event_group = 2 : i64}} : (!moe.tensor<[16, 8], f32>, !moe.tensor<[2, 8, 4], f32>, !moe.tensor<[2], i64>) -> !moe.tensor<[16, 4], f32>
}

// -----

// Enum values: each op kind has its own advance modes.
moe.graph "g" {
  %off = moe.input "off" : !moe.tensor<[4], i64>
  %x = moe.input "x" : !moe.tensor<[32, 8], f32>
  %soff = moe.input "soff" : !moe.tensor<[4], i64>
  %n = moe.input "n" : !moe.tensor<[4], i32>
  // expected-error@+1 {{'moe.dispatch' op 'dispatch': fill key 'advance' must be one of: "vector" "vector_only"}}
  %a = moe.dispatch "dispatch"(%off, %x, %soff, %n) -> "a" {split = #moe.split<inputs = [], output_dims = [0]>, split_value = 4 : i64, fill = {advance = "cube"}} : (!moe.tensor<[4], i64>, !moe.tensor<[32, 8], f32>, !moe.tensor<[4], i64>, !moe.tensor<[4], i32>) -> !moe.tensor<[32, 8], f32>
}

// -----

moe.graph "g" {
  %off = moe.input "off" : !moe.tensor<[4], i64>
  %x = moe.input "x" : !moe.tensor<[32, 8], f32>
  %soff = moe.input "soff" : !moe.tensor<[4], i64>
  %n = moe.input "n" : !moe.tensor<[4], i32>
  // expected-error@+1 {{'moe.combine' op 'combine': fill key 'advance' must be one of: "vector" "vector_only"}}
  %a = moe.combine "combine"(%off, %x, %soff, %n) -> "a" {split = #moe.split<inputs = [1:0], output_dims = [0]>, split_value = 4 : i64, fill = {advance = 1 : i64}} : (!moe.tensor<[4], i64>, !moe.tensor<[32, 8], f32>, !moe.tensor<[4], i64>, !moe.tensor<[4], i32>) -> !moe.tensor<[32, 8], f32>
}

// -----

moe.graph "g" {
  %y = moe.input "y" : !moe.tensor<[16, 8], f32>
  %w = moe.input "w" : !moe.tensor<[2, 8, 4], f32>
  %gl = moe.input "gl" : !moe.tensor<[2], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': fill key 'advance' must be one of: "cube" "cube_only" "cube_custom"}}
  %a = moe.gmm "m"(%y, %w, %gl) -> "a" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4 : i64, fill = {advance = "vector"}} : (!moe.tensor<[16, 8], f32>, !moe.tensor<[2, 8, 4], f32>, !moe.tensor<[2], i64>) -> !moe.tensor<[16, 4], f32>
}

// -----

// Expression keys take an integer or an expression string.
moe.graph "g" {
  %off = moe.input "off" : !moe.tensor<[4], i64>
  %x = moe.input "x" : !moe.tensor<[32, 8], f32>
  %soff = moe.input "soff" : !moe.tensor<[4], i64>
  %n = moe.input "n" : !moe.tensor<[4], i32>
  // expected-error@+1 {{'moe.dispatch' op 'dispatch': fill key 'event_group' must be an integer or an expression}}
  %a = moe.dispatch "dispatch"(%off, %x, %soff, %n) -> "a" {split = #moe.split<inputs = [], output_dims = [0]>, split_value = 4 : i64, fill = {event_group = 1.5 : f32}} : (!moe.tensor<[4], i64>, !moe.tensor<[32, 8], f32>, !moe.tensor<[4], i64>, !moe.tensor<[4], i32>) -> !moe.tensor<[32, 8], f32>
}

// -----

moe.graph "g" {
  %off = moe.input "off" : !moe.tensor<[4], i64>
  %x = moe.input "x" : !moe.tensor<[32, 8], f32>
  %soff = moe.input "soff" : !moe.tensor<[4], i64>
  %n = moe.input "n" : !moe.tensor<[4], i32>
  // expected-error@+1 {{'moe.dispatch' op 'dispatch': fill key 'event_group': column 14: expected an operand after '+'}}
  %a = moe.dispatch "dispatch"(%off, %x, %soff, %n) -> "a" {split = #moe.split<inputs = [], output_dims = [0]>, split_value = 4 : i64, fill = {event_group = "num_experts +"}} : (!moe.tensor<[4], i64>, !moe.tensor<[32, 8], f32>, !moe.tensor<[4], i64>, !moe.tensor<[4], i32>) -> !moe.tensor<[32, 8], f32>
}

// -----

moe.graph "g" {
  %y = moe.input "y" : !moe.tensor<[16, 8], f32>
  %w = moe.input "w" : !moe.tensor<[2, 8, 4], f32>
  %gl = moe.input "gl" : !moe.tensor<[2], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': fill key 'event_delta' must be an integer or an expression}}
  %a = moe.gmm "m"(%y, %w, %gl) -> "a" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4 : i64, fill = {event_delta = [1]}} : (!moe.tensor<[16, 8], f32>, !moe.tensor<[2, 8, 4], f32>, !moe.tensor<[2], i64>) -> !moe.tensor<[16, 4], f32>
}

// -----

moe.graph "g" {
  %y = moe.input "y" : !moe.tensor<[16, 8], f32>
  %w = moe.input "w" : !moe.tensor<[2, 8, 4], f32>
  %gl = moe.input "gl" : !moe.tensor<[2], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': fill key 'num_cube_cores': column 3: expected an operator or the end of the expression, got '2'}}
  %a = moe.gmm "m"(%y, %w, %gl) -> "a" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4 : i64, fill = {num_cube_cores = "2 2"}} : (!moe.tensor<[16, 8], f32>, !moe.tensor<[2, 8, 4], f32>, !moe.tensor<[2], i64>) -> !moe.tensor<[16, 4], f32>
}

// -----

// Boolean keys.
moe.graph "g" {
  %y = moe.input "y" : !moe.tensor<[16, 8], f32>
  %w = moe.input "w" : !moe.tensor<[2, 8, 4], f32>
  %gl = moe.input "gl" : !moe.tensor<[2], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': fill key 'rank_in_event' must be a boolean}}
  %a = moe.gmm "m"(%y, %w, %gl) -> "a" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4 : i64, fill = {rank_in_event = 1 : i64}} : (!moe.tensor<[16, 8], f32>, !moe.tensor<[2, 8, 4], f32>, !moe.tensor<[2], i64>) -> !moe.tensor<[16, 4], f32>
}

// -----

moe.graph "g" {
  %y = moe.input "y" : !moe.tensor<[16, 8], f32>
  %w = moe.input "w" : !moe.tensor<[2, 8, 4], f32>
  %gl = moe.input "gl" : !moe.tensor<[2], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': fill key 'global_trigger' must be a boolean}}
  %a = moe.gmm "m"(%y, %w, %gl) -> "a" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4 : i64, fill = {global_trigger = "true"}} : (!moe.tensor<[16, 8], f32>, !moe.tensor<[2, 8, 4], f32>, !moe.tensor<[2], i64>) -> !moe.tensor<[16, 4], f32>
}

// -----

moe.graph "g" {
  %y = moe.input "y" : !moe.tensor<[16, 8], f32>
  %w = moe.input "w" : !moe.tensor<[2, 8, 4], f32>
  %gl = moe.input "gl" : !moe.tensor<[2], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': fill key 'out_offset' must be a boolean}}
  %a = moe.gmm "m"(%y, %w, %gl) -> "a" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4 : i64, fill = {out_offset = 0 : i64}} : (!moe.tensor<[16, 8], f32>, !moe.tensor<[2, 8, 4], f32>, !moe.tensor<[2], i64>) -> !moe.tensor<[16, 4], f32>
}

// -----

// offset_inputs: a list of operand indices.
moe.graph "g" {
  %y = moe.input "y" : !moe.tensor<[16, 8], f32>
  %w = moe.input "w" : !moe.tensor<[2, 8, 4], f32>
  %gl = moe.input "gl" : !moe.tensor<[2], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': fill key 'offset_inputs' must be a list of operand indices}}
  %a = moe.gmm "m"(%y, %w, %gl) -> "a" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4 : i64, fill = {offset_inputs = 0 : i64}} : (!moe.tensor<[16, 8], f32>, !moe.tensor<[2, 8, 4], f32>, !moe.tensor<[2], i64>) -> !moe.tensor<[16, 4], f32>
}

// -----

moe.graph "g" {
  %y = moe.input "y" : !moe.tensor<[16, 8], f32>
  %w = moe.input "w" : !moe.tensor<[2, 8, 4], f32>
  %gl = moe.input "gl" : !moe.tensor<[2], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': fill key 'offset_inputs' holds 3 : i64, not an operand index below 3}}
  %a = moe.gmm "m"(%y, %w, %gl) -> "a" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4 : i64, fill = {offset_inputs = [0, 3]}} : (!moe.tensor<[16, 8], f32>, !moe.tensor<[2, 8, 4], f32>, !moe.tensor<[2], i64>) -> !moe.tensor<[16, 4], f32>
}

// -----

moe.graph "g" {
  %y = moe.input "y" : !moe.tensor<[16, 8], f32>
  %w = moe.input "w" : !moe.tensor<[2, 8, 4], f32>
  %gl = moe.input "gl" : !moe.tensor<[2], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': fill key 'offset_inputs' holds -1 : i64, not an operand index below 3}}
  %a = moe.gmm "m"(%y, %w, %gl) -> "a" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4 : i64, fill = {offset_inputs = [-1]}} : (!moe.tensor<[16, 8], f32>, !moe.tensor<[2, 8, 4], f32>, !moe.tensor<[2], i64>) -> !moe.tensor<[16, 4], f32>
}

// -----

moe.graph "g" {
  %y = moe.input "y" : !moe.tensor<[16, 8], f32>
  %w = moe.input "w" : !moe.tensor<[2, 8, 4], f32>
  %gl = moe.input "gl" : !moe.tensor<[2], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': fill key 'offset_inputs' holds "a", not an operand index below 3}}
  %a = moe.gmm "m"(%y, %w, %gl) -> "a" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4 : i64, fill = {offset_inputs = ["a"]}} : (!moe.tensor<[16, 8], f32>, !moe.tensor<[2, 8, 4], f32>, !moe.tensor<[2], i64>) -> !moe.tensor<[16, 4], f32>
}

// -----

// Every key of each kind, well formed: no diagnostics.
// expected-no-diagnostics
moe.graph "g" {
  %off = moe.input "off" : !moe.tensor<[4], i64>
  %x = moe.input "x" : !moe.tensor<[32, 8], f32>
  %soff = moe.input "soff" : !moe.tensor<[4], i64>
  %n = moe.input "n" : !moe.tensor<[4], i32>
  %y = moe.input "y" : !moe.tensor<[16, 8], f32>
  %w = moe.input "w" : !moe.tensor<[2, 8, 4], f32>
  %gl = moe.input "gl" : !moe.tensor<[2], i64>
  %a = moe.dispatch "dispatch"(%off, %x, %soff, %n) -> "a" {split = #moe.split<inputs = [], output_dims = [0]>, split_value = 4 : i64, fill = {advance = "vector_only", event_group = "num_experts * 2"}} : (!moe.tensor<[4], i64>, !moe.tensor<[32, 8], f32>, !moe.tensor<[4], i64>, !moe.tensor<[4], i32>) -> !moe.tensor<[32, 8], f32>
  %c = moe.combine "combine"(%off, %x, %soff, %n) -> "c" {split = #moe.split<inputs = [1:0], output_dims = [0]>, split_value = 4 : i64, fill = {advance = "vector", event_group = 1 : i64}} : (!moe.tensor<[4], i64>, !moe.tensor<[32, 8], f32>, !moe.tensor<[4], i64>, !moe.tensor<[4], i32>) -> !moe.tensor<[32, 8], f32>
  %m = moe.gmm "m"(%y, %w, %gl) -> "mo" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4 : i64, fill = {advance = "cube_custom", event_delta = "single_rank_expert_num", global_trigger = true, num_cube_cores = 24 : i64, offset_inputs = [0, 1, 2], out_offset = false, rank_in_event = true}} : (!moe.tensor<[16, 8], f32>, !moe.tensor<[2, 8, 4], f32>, !moe.tensor<[2], i64>) -> !moe.tensor<[16, 4], f32>
}

// -----

moe.graph "g" {
  %off = moe.input "off" : !moe.tensor<[4], i64>
  %x = moe.input "x" : !moe.tensor<[8, 16], f32>
  %sz = moe.input "sz" : !moe.tensor<[4], i32>
  // expected-error@+1 {{'moe.dispatch' op 'd': fill key 'event_group' must be an integer or an expression}}
  %t = moe.dispatch "d"(%off, %x, %off, %sz) -> "t" {fill = {event_group = true}, split = #moe.split<inputs = [], output_dims = [0]>, split_value = 4 : i64} : (!moe.tensor<[4], i64>, !moe.tensor<[8, 16], f32>, !moe.tensor<[4], i64>, !moe.tensor<[4], i32>) -> !moe.tensor<[8, 16], f32>
}

// -----

moe.graph "g" {
  %y = moe.input "y" : !moe.tensor<[8, 8], i32>
  // expected-error@+1 {{'moe.swiglu' op 's': input 'y' must have element type act, f32 or bf16, got i32}}
  %a = moe.swiglu "s"(%y) -> "a" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4 : i64} : (!moe.tensor<[8, 8], i32>) -> !moe.tensor<[8, 4], i32>
}
