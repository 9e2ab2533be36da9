/* The cases of packed_gemm.c's switches over a tile's row count, 1..MR: each expands the
   includer's TILE(R) (a constant row count per case: the accumulators stay in registers). */
#if MR >= 12
TILE(12)
#endif
#if MR >= 11
TILE(11)
#endif
#if MR >= 10
TILE(10)
#endif
#if MR >= 9
TILE(9)
#endif
#if MR >= 8
TILE(8)
#endif
#if MR >= 7
TILE(7)
#endif
#if MR >= 6
TILE(6)
#endif
#if MR >= 5
TILE(5)
#endif
#if MR >= 4
TILE(4)
#endif
#if MR >= 3
TILE(3)
#endif
#if MR >= 2
TILE(2)
#endif
#if MR >= 1
TILE(1)
#endif
